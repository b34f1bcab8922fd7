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


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"PYTHONPATH": str(ROOT)}
    if ci is not None:
        env["CI"] = ci
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
            "--rootdir", str(tmp_path), str(tmp_path / "tests")]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_ci_fails_on_a_skip_not_on_the_allow_list_and_names_it(tmp_path: Path) -> None:
    assert ALLOWED in CI_ALLOWED_SKIPS and all(reason for reason in CI_ALLOWED_SKIPS.values())
    path, name = ALLOWED.split("::")
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(SKIPPING.format(name=name, reason="a GPU case"))
    (tmp_path / "tests" / "test_prerequisite.py").write_text(
        SKIPPING.format(name="test_needs_a_browser", reason="chromium is not installed"))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    ci = _run(tmp_path, "true")
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "tests/test_prerequisite.py::test_needs_a_browser: Skipped: chromium is not installed" in ci.stdout
    assert "a GPU case" not in ci.stdout.split("skips not allowed under CI", 1)[1]  # the allowed one
    for ci_value in (None, "false"):
        local = _run(tmp_path, ci_value)
        assert local.returncode == 0 and "2 skipped" in local.stdout, local.stdout + local.stderr
