#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go: the CUDA tests, then `kvgate bench gpu`.
#
#   scripts/gpu_checks.sh OUT_DIR [bench gpu arguments...]
#
# Runs with the python3 on PATH and the repository on PYTHONPATH (no install needed beyond torch, triton,
# transformers and the engine's own dependencies). Where the default model's package is missing, set
# KVGATE_TEST_TOKENIZER_DIR to a directory holding its tokenizer files (the tiny test models use them),
# and pass the bench --model-dir (a model directory or a .gguf). Logs and the bench's JSON go to OUT_DIR.
# PYTEST_S and BENCH_S bound each part (seconds; defaults 240 and 400).
set -uo pipefail
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR [bench gpu arguments...]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
timeout "${PYTEST_S:-240}" python3 -m pytest -q -p no:cacheprovider --timeout 200 -rs \
  tests/engine/test_overlap_steps.py tests/engine/test_cuda_decode.py \
  tests/engine/test_determinism.py::test_batch_invariant_bits_survive_any_batch_on_a_gpu \
  tests/kernels/test_split_decode.py tests/kernels/test_triton_bi.py tests/kernels/test_kv_quant.py \
  tests/kernels/test_triton_prefill.py 2>&1 | tee "$out/pytest.log" | tail -30
timeout "${BENCH_S:-400}" python3 -m bench.gpu_bench --out "$out/gpu.json" "$@" 2>&1 \
  | tee "$out/bench.log" | tail -40
