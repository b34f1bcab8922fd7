"""The import graph goes one way: gateway -> {policies, audit, engine} and engine -> kernels."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("gateway", "policies", "audit", "engine", "kernels", "migrations", "bench")
ALLOWED = {
    "gateway": {"gateway", "policies", "audit", "engine"},
    "engine": {"engine", "kernels"},
    "kernels": {"kernels"},
    "policies": {"policies"},
    "audit": {"audit"},
}
# The CLI is the outermost composition layer: it may also reach the benchmark harness.
CLI_EXTRA = {"bench"}
# kernels may import only torch/triton (and the standard library)
KERNELS_THIRD_PARTY = {"torch", "triton"}
# the engine must not know about the web stack, the database or logging configuration
ENGINE_FORBIDDEN = {
    "litestar",
    "sqlalchemy",
    "structlog",
    "pydantic",
    "pydantic_settings",
    "gateway",
    "audit",
    "policies",
    "uvicorn",
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "__import__"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.add(node.args[0].value.split(".")[0])
    return out


def _package_imports(package: str) -> dict[Path, set[str]]:
    return {p: _imports(p) for p in sorted((ROOT / package).rglob("*.py"))}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_project_imports_go_one_way(package):
    for path, names in _package_imports(package).items():
        allowed = ALLOWED[package] | (CLI_EXTRA if path.parent.name == "cli" else set())
        bad = {n for n in names if n in PROJECT} - allowed
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_kernels_import_only_torch_and_triton():
    stdlib = sys.stdlib_module_names
    for path, names in _package_imports("kernels").items():
        bad = {n for n in names if n not in stdlib and n != "__future__"} - KERNELS_THIRD_PARTY - {"kernels"}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_engine_does_not_import_web_or_storage_stack():
    for path, names in _package_imports("engine").items():
        bad = names & ENGINE_FORBIDDEN
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
