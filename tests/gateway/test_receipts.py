"""The request.finished audit event carries a determinism receipt: mode, fingerprint, replay parameters,
keyed prompt hash and per-choice token hash chains; never the prompt."""

from __future__ import annotations

import re

import orjson
from sqlalchemy import select

from audit.tables import audit_events
from tests.gateway.conftest import Gateway
from tests.gateway.test_openai import tenant_headers

PROMPT = "receipts never hold this sentence"


async def _events(gw: Gateway, name: str) -> list[dict]:
    async with gw.runtime.db.connect() as conn:
        rows = (
            (
                await conn.execute(
                    select(audit_events.c.data)
                    .where(audit_events.c.name == name)
                    .order_by(audit_events.c.seq)
                )
            )
            .scalars()
            .all()
        )
    return [orjson.loads(r) for r in rows]


async def _raw_rows(gw: Gateway) -> str:
    async with gw.runtime.db.connect() as conn:
        rows = (await conn.execute(select(audit_events))).mappings().all()
    return repr([dict(r) for r in rows])


async def test_sampled_batch_invariant_receipt(gw: Gateway) -> None:
    h = await tenant_headers(gw)
    body = {
        "model": gw.runtime.engine.model_name,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 5,
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 40,
        "n": 2,
        "stop": ["\n\n"],
        "determinism": "batch_invariant",
    }
    r = await gw.client.post("/v1/chat/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    [admitted] = await _events(gw, "request.admitted")
    [finished] = await _events(gw, "request.finished")
    fp = gw.runtime.engine.determinism.fingerprints["batch_invariant"]
    assert finished["system_fingerprint"] == r.json()["system_fingerprint"] == fp
    assert finished["determinism"] == admitted["determinism"] == "batch_invariant"
    assert finished["prompt_hash"] == admitted["prompt_hash"] and len(finished["prompt_hash"]) == 32
    assert (finished["kind"], finished["model"], finished["num_choices"]) == ("chat", body["model"], 2)
    assert (finished["temperature"], finished["top_p"], finished["top_k"]) == (0.8, 0.9, 40)
    assert finished["max_tokens"] == 5 and finished["stop"] == ["\n\n"]
    # Unseeded but sampled: the gateway drew the seed, so the draws can be replayed.
    assert isinstance(finished["seed"], int) and 0 <= finished["seed"] < 2**32
    assert isinstance(finished["arrival_step"], int) and finished["arrival_step"] >= 0
    hashes = finished["token_hashes"]
    assert len(hashes) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", x) for x in hashes)
    assert PROMPT not in await _raw_rows(gw)


async def test_fast_greedy_receipt_has_no_chain_and_no_seed(gw: Gateway) -> None:
    h = await tenant_headers(gw)
    body = {"model": gw.runtime.engine.model_name, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    r = await gw.client.post("/v1/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    [finished] = await _events(gw, "request.finished")
    assert finished["determinism"] == "fast" and finished["kind"] == "text"
    assert finished["system_fingerprint"] == gw.runtime.engine.determinism.fingerprints["fast"]
    assert "token_hashes" not in finished and "seed" not in finished and "stop" not in finished


async def test_a_callers_seed_is_recorded_as_given(gw: Gateway) -> None:
    h = await tenant_headers(gw)
    body = {
        "model": gw.runtime.engine.model_name,
        "prompt": PROMPT,
        "max_tokens": 3,
        "seed": 2**62 + 7,
        "determinism": "fixed",
        "stream": True,
    }
    r = await gw.client.post("/v1/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    [finished] = await _events(gw, "request.finished")
    assert finished["seed"] == 2**62 + 7 and finished["determinism"] == "fixed"
    assert len(finished["token_hashes"]) == 1
