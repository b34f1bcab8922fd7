#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench (CPU, native) from the llama-cpp-python sdist.
#
# Usage: scripts/build_llama_cpp.sh [VERSION]      (or: kvgate bench build-llamacpp)
#   VERSION      llama-cpp-python release whose vendored llama.cpp is built (default below)
#   KVGATE_CACHE cache root (default ~/.cache/kvgate); binaries land in
#                $KVGATE_CACHE/llama.cpp/VERSION/bin
#   PYTHON       interpreter whose pip downloads the sdist (default python3)
#   JOBS         parallel compile jobs (default: all cores)
#   KEEP_BUILD=1 keep the unpacked source and build tree (otherwise removed after success)
#   AMX=1        let -march=native use Intel AMX (off by default: on the cloud VMs we measured on, which
#                report amx_tile, ggml's first ldtilecfg is a general protection fault at start-up)
# About eleven minutes on 2 cores. Needs cmake, a C++17 compiler and network access for pip only:
# the build itself fetches nothing (no curl, no prebuilt web UI, no OpenSSL; llama-server speaks HTTP).
set -euo pipefail

version="${1:-${LLAMA_CPP_PYTHON_VERSION:-0.3.36}}"
cache="${KVGATE_CACHE:-$HOME/.cache/kvgate}"
dest="$cache/llama.cpp/$version"
python="${PYTHON:-python3}"
jobs="${JOBS:-$(nproc)}"

if [[ -x "$dest/bin/llama-server" && -x "$dest/bin/llama-bench" ]]; then
    echo "already built: $dest/bin"
    exit 0
fi

work="$dest/src"
rm -rf "$work"
mkdir -p "$work" "$dest/bin"
echo "downloading llama-cpp-python==$version sdist"
"$python" -m pip download --quiet --no-deps --no-binary :all: --dest "$work" \
    "llama-cpp-python==$version"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"

no_amx=""
if [[ "${AMX:-0}" != "1" ]]; then
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit -mno-* win over -march=native in GCC
fi

echo "configuring $src"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF

echo "building llama-server llama-bench with $jobs jobs"
cmake --build "$work/build" --config Release -j "$jobs" --target llama-server llama-bench

install -m 0755 "$work/build/bin/llama-server" "$work/build/bin/llama-bench" "$dest/bin/"
if [[ "${KEEP_BUILD:-0}" != "1" ]]; then
    rm -rf "$work"
fi
echo "built: $dest/bin"
"$dest/bin/llama-server" --version 2>&1 | head -n 2 || true
