"""``GET /admin/v1/audit/export``: a signed bundle that verifies offline, strict params, fail-closed 503."""

import csv
import tarfile
from pathlib import Path

import orjson
import pytest
from sqlalchemy import select, text

from audit import bundle
from audit.keys import PUBLIC_KEY_FILE, load_public_key
from audit.tables import audit_checkpoints, audit_events
from audit.verify import verify_bundle
from gateway.cli import app as cli_app

EXPORT = "/admin/v1/audit/export"


async def _traffic(gw) -> tuple[str, str]:
    """Two tenants, one completion each: events for both in the trail."""
    model = gw.runtime.engine.model_name
    ids = []
    for _ in range(2):
        tid, key = await gw.make_tenant()
        r = await gw.client.post(
            "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": model, "prompt": "hello", "max_tokens": 2},
        )
        assert r.status_code == 200
        ids.append(tid)
    return ids[0], ids[1]


def _save(tmp_path: Path, name: str, body: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(body)
    return path


def _member(path: Path, name: str) -> bytes:
    with tarfile.open(path) as tar:
        return tar.extractfile(name).read()


async def test_export_streams_a_bundle_that_verifies(gw, tmp_path):
    t1, _ = await _traffic(gw)
    key = load_public_key((gw.settings.data_dir / PUBLIC_KEY_FILE).read_bytes())
    r = await gw.client.get(EXPORT, headers=gw.admin())
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-tar"
    assert "attachment" in r.headers["content-disposition"]
    full = _save(tmp_path, "full.tar", r.content)
    with tarfile.open(full) as tar:
        assert set(tar.getnames()) == {
            bundle.MANIFEST, bundle.SIGNATURE, bundle.PUBLIC_KEY, bundle.CHAIN, "events.jsonl"
        }
    result = verify_bundle(full, key)
    assert result.ok and result.is_key_pinned, result
    names = [orjson.loads(line)["name"] for line in _member(full, "events.jsonl").splitlines()]
    assert {"auth.success", "request.admitted", "request.finished"} <= set(names)

    r = await gw.client.get(EXPORT, headers=gw.admin(), params={"tenant": t1, "format": "csv"})
    assert r.status_code == 200, r.text
    only = _save(tmp_path, "t1.tar", r.content)
    result = verify_bundle(only, key)
    assert result.ok and result.tenant == t1 and result.num_events >= 3, result
    rows = list(csv.reader(_member(only, "events.csv").decode().splitlines()[1:]))
    assert rows and all(bundle.decode_csv_row(row)["tenant_id"] == t1 for row in rows)


async def test_export_is_itself_audited_and_the_cli_verifies_it(gw, tmp_path):
    from typer.testing import CliRunner

    await _traffic(gw)
    r = await gw.client.get(EXPORT, headers=gw.admin(), params={"since": "2000-01-01", "until": "2999-01-01"})
    assert r.status_code == 200, r.text
    async with gw.runtime.db.connect() as conn:
        rows = (await conn.execute(select(audit_events).where(audit_events.c.name == "audit.exported"))).all()
    admin_id = gw.admin_token.split("_")[1]
    assert [(row.actor, orjson.loads(row.data)["format"]) for row in rows] == [(admin_id, "jsonl")]
    path = _save(tmp_path, "b.tar", r.content)
    pub = gw.settings.data_dir / PUBLIC_KEY_FILE
    out = CliRunner().invoke(cli_app, ["audit", "verify", str(path), "--public-key", str(pub)])
    assert out.exit_code == 0 and out.output.startswith("OK:"), out.output


async def test_a_chat_made_of_its_own_ids_stays_in_its_tenants_export(gw, tmp_path):
    tid, key = await gw.make_tenant()
    key_id = key.split("_")[1]
    chat = {"model": gw.runtime.engine.model_name, "max_tokens": 2, "messages": [
        {"role": "system", "content": tid}, {"role": "user", "content": key_id}]}
    r = await gw.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=chat)
    assert r.status_code == 200, r.text
    r = await gw.client.get(EXPORT, headers=gw.admin(), params={"tenant": tid})
    assert r.status_code == 200, r.text
    path = _save(tmp_path, "t.tar", r.content)
    key = load_public_key((gw.settings.data_dir / PUBLIC_KEY_FILE).read_bytes())
    assert verify_bundle(path, key).ok
    records = [orjson.loads(line) for line in _member(path, "events.jsonl").splitlines()]
    assert [r["name"] for r in records] == ["auth.success", "request.admitted", "request.finished"]
    assert all((r["tenant_id"], r["key_id"]) == (tid, key_id) for r in records)


@pytest.mark.parametrize(
    "params,param",
    [
        ({"since": "2026-05-02", "until": "2026-05-01"}, "until"),
        ({"format": "xml"}, "format"),
        ({"since": "yesterday"}, "since"),
        ({"until": "2026-13-40"}, "until"),
        ({"tenant": "no-such-tenant"}, "tenant"),
    ],
)
async def test_bad_params_are_400(gw, params, param):
    r = await gw.client.get(EXPORT, headers=gw.admin(), params=params)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


async def test_tenant_keys_and_anonymous_callers_cannot_export(gw):
    _, key = await gw.make_tenant()
    r = await gw.client.get(EXPORT, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_token_required"
    assert (await gw.client.get(EXPORT)).status_code == 401


async def test_unavailable_store_is_a_clean_503(gw):
    await _traffic(gw)
    # A damaged store: appends still work (they touch no checkpoint before seq 1000), exports cannot.
    async with gw.runtime.db.begin() as conn:
        await conn.execute(text("DROP TABLE audit_checkpoints"))
    r = await gw.client.get(EXPORT, headers=gw.admin())
    assert r.status_code == 503
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "audit_unavailable"
    async with gw.runtime.db.connect() as conn:
        names = (await conn.execute(select(audit_events.c.name))).scalars().all()
    assert "audit.exported" not in names and names[-1] == "auth.success"  # the attempt itself is on record
    async with gw.runtime.db.begin() as conn:  # repaired, so the shutdown checkpoint can be written
        await conn.run_sync(audit_checkpoints.create)


async def test_admitted_events_carry_a_keyed_prompt_hash(gw):
    _, key = await gw.make_tenant()
    model = gw.runtime.engine.model_name
    for prompt in ("same prompt", "same prompt", "other prompt"):
        r = await gw.client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": model, "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200
    async with gw.runtime.db.connect() as conn:
        rows = (await conn.execute(select(audit_events.c.data).where(
            audit_events.c.name == "request.admitted").order_by(audit_events.c.seq))).scalars().all()
    hashes = [orjson.loads(row)["prompt_hash"] for row in rows]
    assert hashes[0] == hashes[1] != hashes[2] and len(hashes[0]) == 32
    ids = gw.runtime.engine.tokenizer("same prompt")["input_ids"]
    assert hashes[0] == gw.runtime.prompt_hash(ids)  # over the exact token ids, keyed by the audit keys
