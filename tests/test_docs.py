"""The user documentation against the code: the generated configuration page, the admin endpoints and
the policy fields."""

from __future__ import annotations

import difflib
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from typer.testing import CliRunner

from gateway.cli import app
from gateway.cli.docs_cmds import configuration_markdown
from gateway.guards import ADMIN_ROUTE_SCOPES
from gateway.settings import Settings
from gateway.settings_doc import REGENERATE, render_configuration, undocumented_fields
from policies import Policy

ROOT = Path(__file__).resolve().parents[1]
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
