"""docs/architecture.md against the code: every path, module, class, function and constant it cites in
backticks exists, so the page fails the suite when a name it cites goes away."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gateway.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGES = ("gateway", "engine", "kernels", "audit", "policies", "bench", "kvgate", "migrations")
PATH_ROOTS = (*PACKAGES, "tests", "docs", "scripts")
FILE_SUFFIXES = (".py", ".md", ".toml", ".ini", ".mako", ".json")
# Modules outside the project a page may cite dotted names of.
THIRD_PARTY = {"torch", "triton", "uvicorn", "litestar", "sqlalchemy", "alembic", "structlog", "typer",
               "pydantic"}

PATH = re.compile(r"^[\w.-]+(?:/[\w.-]*)+$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
PASCAL = re.compile(r"^_?[A-Z]\w*[a-z]\w*$")
CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$")
CALL = re.compile(r"^([A-Za-z_][\w.]*)\(\)$")
ENV = re.compile(r"^KVGATE_[A-Z0-9_]+$")


@dataclass
class CodeIndex:
    """What the project's source defines: each module's top-level names and the names it imports, and
    each class's members (methods, fields, class attributes and attributes set on ``self``)."""

    modules: dict[str, Path] = field(default_factory=dict)
    defined: dict[str, set[str]] = field(default_factory=dict)
    imported: dict[str, set[str]] = field(default_factory=dict)
    members: dict[str, set[str]] = field(default_factory=dict)
    strings: dict[str, set[str]] = field(default_factory=dict)

    @classmethod
    def build(cls) -> CodeIndex:
        index = cls()
        for package in PACKAGES:
            for path in sorted((ROOT / package).rglob("*.py")):
                parts = path.relative_to(ROOT).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                index.modules[name] = path
                index._add_module(name, ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        return index

    def _add_module(self, module: str, tree: ast.Module) -> None:
        defined, imported, strings = set(), set(), set()
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                self._add_class(node)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif (isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant)
                  and isinstance(node.value.value, str)):
                strings.add(node.value.value)
            defined |= _names_bound(node)
        self.defined[module], self.imported[module], self.strings[module] = defined, imported, strings

    def _add_class(self, node: ast.ClassDef) -> None:
        members = self.members.setdefault(node.name, set())
        for item in node.body:
            members |= _names_bound(item)
            if isinstance(item, ast.ClassDef):
                self._add_class(item)
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                    and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                members.add(sub.attr)

    def is_defined(self, name: str) -> bool:
        """Whether some module defines ``name`` at its top level (or some class, a nested class of it)."""
        return name in self.members or any(name in names for names in self.defined.values())

    def _resolve_module(self, parts: list[str]) -> tuple[str, list[str]] | None:
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in self.modules:
                return ".".join(parts[:end]), parts[end:]
        return None

    def problem(self, dotted: str) -> str | None:
        """Why ``dotted`` (``module``, ``module.Name``, ``module.Class.member``, ``Class.member``, with
        ``module`` whole or by its last name) names nothing in the code, or ``None`` when it does."""
        parts = dotted.split(".")
        if parts[0] in PACKAGES:
            found = self._resolve_module(parts)
            return f"no module {dotted}" if found is None else self._name_problem(*found)
        # A module by its last name (``settlement.finish``): any module of that name may define it.
        short = [m for m in self.modules if m.rsplit(".", 1)[-1] == parts[0]]
        if short:
            problems = [self._name_problem(module, parts[1:]) for module in short]
            return None if None in problems else problems[0]
        if PASCAL.match(parts[0]):
            return self._member_problem(parts[0], parts[1:]) if self.is_defined(parts[0]) else \
                f"no class {parts[0]}"
        if parts[0] in THIRD_PARTY:
            return None
        return f"{parts[0]} is neither a project package, a class of the project nor a known library"

    def _name_problem(self, module: str, rest: list[str]) -> str | None:
        if not rest:
            return None
        if rest[0] not in self.defined[module] and not (
                rest[0] in self.imported[module] and self.is_defined(rest[0])):
            return f"{module} defines no {rest[0]}"
        return self._member_problem(rest[0], rest[1:])

    def _member_problem(self, owner: str, rest: list[str]) -> str | None:
        if not rest:
            return None
        if owner not in self.members:
            return f"{owner} is not a class, so it has no {rest[0]}"
        return None if rest[0] in self.members[owner] else f"{owner} has no member {rest[0]}"


def _names_bound(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def code_spans(text: str) -> list[tuple[str, str]]:
    """Inline code spans outside fenced blocks, each with the folder its paths are relative to: the
    package a table row names in its first cell (``| `engine/` | `core.py` ... |``), else the root."""
    spans = []
    for line in re.sub(r"```.*?```", "", text, flags=re.S).splitlines():
        row = re.match(r"^\| `([\w/]+/)` \|", line)
        base = row.group(1) if row else ""
        spans += [(span, base) for span in re.findall(r"`([^`\n]+)`", line[row.end():] if row else line)]
    return spans


def _path_problem(name: str, base: str) -> str | None:
    if "/" not in name and not base:
        return None if any(ROOT.rglob(name)) else "no such file"
    return None if (ROOT / base / name).exists() else "no such file or directory"


def unknown_names(text: str, index: CodeIndex, event_names: set[str], env_names: set[str]) -> list[str]:
    """Every code span of ``text`` that looks like a path, a module or class name, a function call, a
    constant or a setting, and names nothing in the tree."""
    problems = []
    for span, base in code_spans(text):
        problem = None
        call = CALL.match(span)
        name = call.group(1) if call else span
        if " " in span or span.startswith(("/", "-")):
            continue
        if "/" in name:
            is_path = name.endswith((*FILE_SUFFIXES, "/")) or name.split("/")[0] in PATH_ROOTS
            if is_path and PATH.match(name):
                problem = _path_problem(name, base)
        elif name.endswith(FILE_SUFFIXES):
            problem = _path_problem(name, base)
        elif ENV.match(name):
            problem = None if name in env_names else "no such setting"
        elif DOTTED.match(name):
            problem = None if name in event_names else index.problem(name)
        elif PASCAL.match(name) or CONSTANT.match(name) or call:
            problem = None if index.is_defined(name) else "defined nowhere in the project"
        if problem:
            problems.append(f"`{span}`: {problem}")
    return problems


@pytest.fixture(scope="module")
def index() -> CodeIndex:
    return CodeIndex.build()


@pytest.fixture(scope="module")
def event_names(index: CodeIndex) -> set[str]:
    return {s for s in index.strings["audit.events"] if "." in s}


ENV_NAMES = {f"{Settings.model_config['env_prefix']}{name}".upper() for name in Settings.model_fields}


def test_every_name_the_architecture_page_cites_exists(index, event_names):
    problems = unknown_names(PAGE.read_text(encoding="utf-8"), index, event_names, ENV_NAMES)
    assert not problems, "docs/architecture.md cites names the code does not have:\n" + "\n".join(problems)


def test_the_page_cites_names_of_every_kind(index, event_names):
    spans = [span for span, _ in code_spans(PAGE.read_text(encoding="utf-8"))]
    assert any(PATH.match(s) and s.endswith(".py") for s in spans)
    assert any(DOTTED.match(s) and s.split(".")[0] in PACKAGES for s in spans)
    assert any(PASCAL.match(s) for s in spans)


@pytest.mark.parametrize("span", [
    "engine/fairness.py", "engin/models/", "engine.time_sharing", "engine.fair.Ledger", "EngineRequestV2",
    "LLMEngine.add_requests", "RECEIPT_FIELD", "creat_app()", "KVGATE_NO_SUCH", "request.admited",
    "engin.fair", "Principal.tenant", "settlement.finished", "_FLAG_DECL", "_SamplingField",
])
def test_a_name_the_code_lacks_is_reported(index, event_names, span):
    assert unknown_names(f"See `{span}`.", index, event_names, ENV_NAMES) != []


@pytest.mark.parametrize("span", [
    "engine/models/", "gateway/cli/serve_cmds.py", "engine.sched.fair", "engine.EngineRequest",
    "audit.events.RECEIPT_FIELDS", "EnginePlace.take", "Runtime.overload", "Policy.share", "create_app()",
    "KVGATE_ENGINE_PROCESS", "request.admitted", "torch.cuda", "text/event-stream", "kvgate serve",
    "settlement.finish",
])
def test_a_name_the_code_has_passes(index, event_names, span):
    assert unknown_names(f"See `{span}`.", index, event_names, ENV_NAMES) == []


def test_a_table_row_of_a_package_checks_its_files_in_that_package(index, event_names):
    row = "| `engine/` | `sched/fair.py`, `models/llama.py` |"
    assert unknown_names(row, index, event_names, ENV_NAMES) == []
    assert unknown_names("| `gateway/` | `fair.py` |", index, event_names, ENV_NAMES) == [
        "`fair.py`: no such file or directory"]
