"""The user documentation against the code: the generated configuration page, admin endpoints and policy
fields, the commands, flags and endpoints the pages name, and their links."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from typer.testing import CliRunner

from gateway.cli.docs_cmds import configuration_markdown
from gateway.guards import ADMIN_ROUTE_SCOPES
from gateway.settings import Settings
from gateway.settings_doc import REGENERATE, render_configuration, undocumented_fields
from kvgate.cli import app
from policies import Policy

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *(ROOT / "docs" / name for name in (
    "configuration.md", "admin-api.md", "operations.md", "architecture.md", "performance.md", "console.md",
    "deploy.md"))]
ADMIN_API = ROOT / "docs" / "admin-api.md"


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_configuration_md_is_what_the_code_generates():
    committed = _read(ROOT / "docs" / "configuration.md")
    generated = configuration_markdown()
    if committed != generated:
        diff = "".join(list(difflib.unified_diff(
            committed.splitlines(True), generated.splitlines(True), "committed", "generated"))[:60])
        pytest.fail(f"docs/configuration.md is stale; regenerate it with `{REGENERATE}` from the "
                    f"repository root.\n{diff}")


def test_every_setting_has_an_attributes_entry():
    missing = undocumented_fields(Settings)
    assert not missing, f"add a line for each to the Attributes list of Settings' docstring: {missing}"


class _NewSettings(BaseSettings):
    """Settings as another release might have them.

    Attributes:
        port: Bind port.
        queue_len: Requests that may wait; ``None``: as many as
            ``port`` allows (a continuation line).
        mode: How it runs.
    """

    model_config = SettingsConfigDict(env_prefix="KVGATE_")

    port: int = 8443
    queue_len: int | None = Field(default=None, ge=1, le=64)
    mode: bool = True


def test_a_setting_added_to_the_class_is_documented_without_touching_the_generator():
    port = SimpleNamespace(name="port", opts=["--port"], secondary_opts=[], help="Bind port.")
    extra = SimpleNamespace(name="dry_run", opts=["--dry-run"], secondary_opts=[], help="Only check.")
    text = render_configuration(_NewSettings, [port, extra])
    assert "| [`KVGATE_QUEUE_LEN`](#kvgate_queue_len) |   | unset |" in text
    assert ("### `KVGATE_QUEUE_LEN`\n\nRequests that may wait; unset: as many as `KVGATE_PORT` allows "
            "(a continuation line).\n\nType: integer (optional); default: unset; allowed: >= 1, <= 64.\n"
            ) in text
    assert "Type: integer; default: `8443`. Flag: `--port`." in text
    assert "Type: boolean; default: `true`." in text
    assert "- `--dry-run`: Only check." in text  # a flag that sets no setting is still listed


def test_docs_config_writes_the_page_and_is_hidden(tmp_path):
    out = tmp_path / "configuration.md"
    result = CliRunner().invoke(app, ["docs", "config", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert _read(out) == configuration_markdown()
    assert typer.main.get_command(app).commands["docs"].hidden  # a maintainer's tool, not in `kvgate --help`


def test_every_admin_route_is_in_the_endpoint_table_with_its_scope():
    text = _read(ADMIN_API)
    missing = [f"| `{method} {path}` | `{scope}` |" for (method, path), scope in ADMIN_ROUTE_SCOPES.items()
               if f"| `{method} {path}` | `{scope}` |" not in text]
    assert not missing, "document these rows in docs/admin-api.md:\n" + "\n".join(missing)


def test_every_policy_field_is_in_the_policy_table():
    text = _read(ADMIN_API)
    missing = [name for name in Policy.model_fields if f"| `{name}` |" not in text]
    assert not missing, f"document these policy fields in docs/admin-api.md: {missing}"


def _app_routes(tmp_path: Path) -> set[tuple[str, str]]:
    from litestar.routes import ASGIRoute

    from gateway.app import create_app

    routes = set()
    for route in create_app(Settings(data_dir=tmp_path)).routes:
        methods = {"POST"} if isinstance(route, ASGIRoute) else set(route.methods)
        routes |= {(m, re.sub(r"\{[^}]*\}", "{}", route.path_format)) for m in methods}
    return routes


def test_every_endpoint_the_pages_name_exists(tmp_path):
    routes = _app_routes(tmp_path)
    unknown = []
    for page in PAGES:
        for method, path in re.findall(r"`(GET|POST|PUT|PATCH|DELETE|OPTIONS) (/[^`\s?]*)", _read(page)):
            if (method, re.sub(r"\{[^}]*\}", "{}", path)) not in routes:
                unknown.append(f"{page.name}: {method} {path}")
    assert not unknown, "no such endpoint:\n" + "\n".join(unknown)


def _code_texts(text: str) -> list[str]:
    """Inline code spans, and each line of shell code blocks (output blocks are not commands)."""
    shell = re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, flags=re.S)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", prose) + [line for block in shell for line in block.splitlines()]


def _invocations(code: str) -> list[list[str]]:
    """The words after each ``kvgate`` command in one line of code, up to a pipe, comment or ``)``."""
    out = []
    for match in re.finditer(r"(?:^|[\s/(])kvgate((?: +[^\s]+)*)", code):
        words = []
        for word in match.group(1).split():
            if word.startswith(("#", "|", "&&", ";", ">")):
                break
            words.append(word.strip("[]").rstrip(")"))
            if word.endswith(")"):
                break
        out.append(words)
    return out


def _check_invocation(words: list[str]) -> str | None:
    command = typer.main.get_command(app)  # typer's own click: groups are told by their `commands`
    for i, word in enumerate(words):
        if word.startswith("-") or not hasattr(command, "commands") or word.isupper():
            break
        if word not in command.commands:
            return f"no command {word!r} after kvgate {' '.join(words[:i])}"
        command = command.commands[word]
    opts = {o for p in command.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))} | {"--help"}
    bad = [w for w in words if w.startswith("--") and w.split("=")[0] not in opts]
    return f"kvgate {' '.join(words)}: no option {bad}" if bad else None


def test_every_command_and_flag_the_pages_name_exists():
    problems = []
    for page in PAGES:
        for code in _code_texts(_read(page)):
            for words in _invocations(code):
                problem = _check_invocation(words)
                if problem:
                    problems.append(f"{page.name}: {problem}")
    assert not problems, "\n".join(problems)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", _read(path), flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _read(page)):
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            path = (page.parent / file_part).resolve() if file_part else page
            if not path.exists() or (anchor and anchor not in _anchors(path)):
                broken.append(f"{page.name}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)
