"""The import graph goes one way: gateway -> {policies, audit, engine} and engine -> kernels; no module
imports another in a circle, nor a private name of another module."""

import ast
import sys
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("gateway", "policies", "audit", "engine", "kernels", "migrations", "bench", "kvgate")
ALLOWED = {
    "gateway": {"gateway", "policies", "audit", "engine"},
    "engine": {"engine", "kernels"},
    "kernels": {"kernels"},
    "policies": {"policies"},
    "audit": {"audit"},
    # The benchmarks measure everything below the command, which alone mounts them (kvgate/cli.py).
    "bench": {"bench", "gateway", "policies", "audit", "engine", "kernels", "migrations"},
    "kvgate": set(PROJECT),
}
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
        bad = {n for n in names if n in PROJECT} - ALLOWED[package]
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


def _project_modules() -> dict[str, Path]:
    """Every module of the project by dotted name; a package is its ``__init__.py``."""
    modules = {}
    for package in PROJECT:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


class _ImportGraph:
    """Which project module imports which, at any depth of its code (module level, functions, type-checking
    blocks), as ``edges[importer][imported] = line``; and each name imported under a leading underscore."""

    def __init__(self) -> None:
        self.modules = _project_modules()
        self.edges: dict[str, dict[str, int]] = {name: {} for name in self.modules}
        self.private_imports: list[str] = []
        for name, path in self.modules.items():
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                self._add(name, path, node)

    def _resolve(self, dotted: str) -> str | None:
        """The project module that importing ``dotted`` runs last: its longest prefix that is a module."""
        parts = dotted.split(".")
        while parts and ".".join(parts) not in self.modules:
            parts.pop()
        return ".".join(parts) or None

    def _edge(self, importer: str, imported: str | None, line: int) -> None:
        if imported is not None and imported != importer:
            self.edges[importer].setdefault(imported, line)

    def _add(self, importer: str, path: Path, node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                self._edge(importer, self._resolve(alias.name), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = importer.split(".") if path.name == "__init__.py" else importer.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            source = self._resolve(base)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                self._edge(importer, submodule if submodule in self.modules else source, node.lineno)
                is_private = alias.name.startswith("_") and not alias.name.startswith("__")
                if is_private and source is not None and source != importer:
                    self.private_imports.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {base}")
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            self._edge(importer, self._resolve(node.args[0].value), node.lineno)

    def circles(self) -> list[set[str]]:
        """The strongly connected components of two or more modules (Tarjan's algorithm, iteratively)."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found = []
        for root in self.edges:
            if root in index:
                continue
            work = [(root, iter(self.edges[root]))]
            index[root] = low[root] = len(index)
            stack.append(root)
            on_stack.add(root)
            while work:
                node, successors = work[-1]
                child = next(successors, None)
                if child is None:
                    work.pop()
                    if work:
                        low[work[-1][0]] = min(low[work[-1][0]], low[node])
                    if low[node] == index[node]:
                        component = set()
                        while node not in component:
                            component.add(stack.pop())
                        on_stack -= component
                        if len(component) > 1:
                            found.append(component)
                elif child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(self.edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
        return found

    def describe_circle(self, component: set[str]) -> str:
        """One shortest cycle through ``component``, each step with the file and line of its import."""
        start = min(component)
        came_from: dict[str, str] = {}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            for child in sorted(self.edges[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    path.reverse()
                    steps = [f"{a} ({self.modules[a].relative_to(ROOT)}:{self.edges[a][b]})"
                             for a, b in zip(path, [*path[1:], start], strict=True)]
                    return " -> ".join([*steps, start])
                if child in component and child not in came_from:
                    came_from[child] = node
                    queue.append(child)
        raise AssertionError(f"no cycle through {start}")


@pytest.fixture(scope="module")
def import_graph() -> _ImportGraph:
    return _ImportGraph()


def test_the_graph_sees_an_import_inside_a_function(import_graph):
    assert "gateway.cli.model_cmds" in import_graph.edges["gateway.cli"]  # from gateway.cli._register


def test_no_modules_import_each_other_in_a_circle(import_graph):
    circles = import_graph.circles()
    assert not circles, "import circles:\n" + "\n".join(import_graph.describe_circle(c) for c in circles)


def test_no_module_imports_a_private_name_of_another(import_graph):
    found = import_graph.private_imports
    assert not found, ("make these public (no leading underscore, with a docstring) or move the code:\n"
                       + "\n".join(found))


# The gateway's rooms: what the request path's services build on stays below them. ``Runtime`` is the
# container the services share, so nothing it reaches may be a service (inference, tenancy) or sit above one.
ABOVE_RUNTIME = ("gateway.inference", "gateway.tenancy", "gateway.controllers", "gateway.console",
                 "gateway.cli", "gateway.app", "gateway.auth", "gateway.guards", "gateway.deps")
BELOW_SERVICES = ("gateway.runtime", "gateway.limits", "gateway.text", "gateway.principal")


def _reachable(graph: _ImportGraph, start: str) -> dict[str, str]:
    """Every project module ``start`` imports at any remove, each with the module that imports it."""
    seen: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in graph.edges[node]:
            if child not in seen and child != start:
                seen[child] = node
                queue.append(child)
    return seen


def _in(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in rooms)


def test_what_the_services_build_on_imports_no_service(import_graph):
    bad = []
    for start in (m for m in import_graph.modules if _in(m, BELOW_SERVICES)):
        bad += [f"{start} reaches {m} (imported by {by})"
                for m, by in _reachable(import_graph, start).items() if _in(m, ABOVE_RUNTIME)]
    assert not bad, "\n".join(bad)


def test_the_room_check_sees_a_service_import(import_graph):
    assert _in("gateway.inference.admission", ABOVE_RUNTIME) and not _in("gateway.inferences", ABOVE_RUNTIME)
    assert "gateway.runtime" in _reachable(import_graph, "gateway.inference.admission")


def _top_level_names(path: Path) -> set[str]:
    """Every name a module binds anywhere in its body (defs, classes, assignments, imports): generous, so
    that a miss is surely a name the module lacks."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_import_of_a_project_module_resolves(import_graph):
    """An import inside a function runs only when the function does (a benchmark's, a command's): each one
    must name a module and names that exist, or a moved module breaks a path no other test walks."""
    modules, names, bad = import_graph.modules, {}, []
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} no module {a.name}" for a in node.names
                        if a.name.split(".")[0] in PROJECT and a.name not in modules]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] in PROJECT:
                if node.module not in modules:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} no module {node.module}")
                    continue
                bound = names.setdefault(node.module, _top_level_names(modules[node.module]))
                missing = [a.name for a in node.names
                           if a.name not in bound and f"{node.module}.{a.name}" not in modules]
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module} has no {n}" for n in missing]
    assert not bad, "\n".join(bad)
