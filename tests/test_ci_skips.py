"""Under CI (CI=true) a skip fails the run unless its test is on tests/conftest.py's allow-list; elsewhere
skips pass as usual. Run in a pytest of its own, with the suite's conftest as its only plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import CI_ALLOWED_SKIPS

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = "tests/kernels/test_split_decode.py::test_block_ids_past_int32_offsets"
SKIPPING = """import pytest

def {name}():
    pytest.skip("{reason}")
"""


def _run_each(tmp_path: Path, ci_values: list[str | None]) -> list[subprocess.CompletedProcess[str]]:
    """One pytest of ``tmp_path/tests`` per value of CI (None: unset), all at once: each spends its
    seconds importing torch and the engine, mostly on one core."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
            "--rootdir", str(tmp_path), str(tmp_path / "tests")]
    procs = []
    for ci in ci_values:
        env = {k: v for k, v in os.environ.items() if k != "CI"} | {"PYTHONPATH": str(ROOT)}
        if ci is not None:
            env["CI"] = ci
        procs.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [proc.communicate(timeout=300) for proc in procs]
    return [subprocess.CompletedProcess(argv, proc.returncode, *output)
            for proc, output in zip(procs, outputs, strict=True)]


def test_ci_fails_on_a_skip_not_on_the_allow_list_and_names_it(tmp_path: Path) -> None:
    assert ALLOWED in CI_ALLOWED_SKIPS and all(reason for reason in CI_ALLOWED_SKIPS.values())
    path, name = ALLOWED.split("::")
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(SKIPPING.format(name=name, reason="a GPU case"))
    (tmp_path / "tests" / "test_prerequisite.py").write_text(
        SKIPPING.format(name="test_needs_a_browser", reason="chromium is not installed"))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    ci, *local_runs = _run_each(tmp_path, ["true", None, "false"])
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "tests/test_prerequisite.py::test_needs_a_browser: Skipped: chromium is not installed" in ci.stdout
    assert "a GPU case" not in ci.stdout.split("skips not allowed under CI", 1)[1]  # the allowed one
    for local in local_runs:
        assert local.returncode == 0 and "2 skipped" in local.stdout, local.stdout + local.stderr
