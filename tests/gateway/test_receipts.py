"""The request.finished audit event carries a determinism receipt: mode, fingerprint, replay parameters,
keyed prompt hash and per-choice token hash chains; never the prompt."""

from __future__ import annotations

import dataclasses
import re

import orjson
from sqlalchemy import select

from audit.events import EVENT_FIELDS, RECEIPT_FIELDS, REQUEST_ADMITTED, REQUEST_FINISHED, make_event
from audit.redact import Redactor
from audit.tables import audit_events
from engine import SamplingParams
from gateway.inference.receipts import (
    NOT_RECORDED,
    RECEIPT_VERSION,
    Receipt,
    receipt_field_names,
    recorded_params,
)
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


# Every recorded SamplingParams field away from its default, so a round trip shows each one survives.
EVERY_PARAMETER = SamplingParams(
    n=2, max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=12345, stop=["END"],
    stop_token_ids=[7], ignore_eos=True, min_tokens=3, logprobs=None, skip_special_tokens=False,
    include_stop_str_in_output=True, allowed_token_ids=[3, 1000], spaces_between_special_tokens=True,
    truncate_prompt_tokens=50, bad_words_token_ids=[[5, 6], [7]],
    determinism="fixed",
    presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={1000: 100.0, 3: -2.5},
)
# A request.finished receipt as written before receipts held every parameter (version 1).
VERSION_1 = {
    "kind": "text", "model": "m", "determinism": "batch_invariant",
    "system_fingerprint": "fp_0a1b2c3d4e5f6a7b", "prompt_hash": "0" * 32, "num_choices": 1, "max_tokens": 8,
    "temperature": 0.7, "top_p": 0.9, "top_k": 5,
    "seed": 12345, "stop": ["END"], "arrival_step": 3, "token_hashes": ["1" * 32],
}


def test_every_sampling_parameter_is_recorded_or_left_out_for_a_stated_reason() -> None:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(NOT_RECORDED) == {"logprobs", "prompt_logprobs", "structured"}
    assert all(NOT_RECORDED.values())
    assert set(recorded_params()) == names - set(NOT_RECORDED)


def test_the_audit_trail_allows_exactly_the_receipts_fields() -> None:
    assert receipt_field_names() == RECEIPT_FIELDS
    assert RECEIPT_FIELDS <= EVENT_FIELDS[REQUEST_FINISHED]
    assert all(Redactor().is_allowed(name) for name in RECEIPT_FIELDS)


async def test_a_receipt_keeps_every_recorded_parameter_through_the_audit_store(gw: Gateway) -> None:
    defaults = SamplingParams()
    unchanged = [n for n in recorded_params() if getattr(EVERY_PARAMETER, n) == getattr(defaults, n)]
    assert not unchanged, f"give {unchanged} a value other than its default above"
    receipt = Receipt("chat", "m", "fp_0a1b2c3d4e5f6a7b", EVERY_PARAMETER, prompt_hash="0" * 32,
                      structured_kind="regex", structured_hash="2" * 32, arrival_step=0,
                      token_hashes=("1" * 32, "3" * 32))
    await gw.runtime.audit_store.append(make_event(REQUEST_FINISHED, request_id="r1", **receipt.fields()))
    [recorded] = await _events(gw, REQUEST_FINISHED)
    assert Receipt.from_fields(recorded) == receipt
    assert recorded["receipt_version"] == RECEIPT_VERSION


def test_a_version_1_receipt_replays_with_the_parameters_it_always_had() -> None:
    receipt = Receipt.from_fields(VERSION_1)
    assert receipt.version == 1 and receipt.structured_kind is None
    assert receipt.sampling_params() == SamplingParams(
        n=1, max_tokens=8, temperature=0.7, top_p=0.9, top_k=5, seed=12345, stop=["END"],
        determinism="batch_invariant",
    )


async def test_what_a_request_says_of_itself_is_accepted_and_audited(gw: Gateway) -> None:
    """OpenAI's metadata, user, service_tier and store: false, and vLLM's request_id, describe a request
    and change no token: accepted, and recorded as sent in its request.admitted event. store: true is a
    400 unless the tenant's policy keeps prompts and completions (nothing would be stored)."""
    from policies import Policy

    h = await tenant_headers(gw)
    body = {"model": gw.runtime.engine.model_name, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "metadata": {"team": "search", "run": "7"}, "user": "u-42",
            "service_tier": "auto", "store": False, "request_id": "client-req.1", "priority": 7,
            "safety_identifier": "hashed-user-42", "prompt_cache_key": "search-v1"}
    r = await gw.client.post("/v1/chat/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    event = [e for e in await _events(gw, REQUEST_ADMITTED) if e.get("client_request_id") == "client-req.1"]
    assert event and event[0]["metadata"] == {"team": "search", "run": "7"} and event[0]["user"] == "u-42"
    assert event[0]["service_tier"] == "auto" and not r.json()["id"].endswith("client-req.1")
    assert event[0]["safety_identifier"] == "hashed-user-42" and "prompt_cache_key" not in event[0]
    assert event[0]["priority"] == 7  # after the tenant's other requests: its policy's is 0
    ahead = body | {"priority": -7, "request_id": "x"}
    assert (await gw.client.post("/v1/chat/completions", headers=h, json=ahead)).is_success
    events = [e for e in await _events(gw, REQUEST_ADMITTED) if e.get("client_request_id") == "x"]
    assert [e["priority"] for e in events] == [0]  # never ahead of what the policy gives
    r = await gw.client.post("/v1/chat/completions", headers=h, json=body | {"store": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "store_unavailable", r.text
    kept = await tenant_headers(gw, Policy(prompt_retention_days=1))
    r = await gw.client.post("/v1/chat/completions", headers=kept, json=body | {"store": True})
    assert r.is_success, r.text
    for bad in ({"metadata": {f"k{i}": "v" for i in range(17)}}, {"metadata": {"k": "v" * 513}},
                {"request_id": "has space"}, {"service_tier": "gold"}, {"safety_identifier": "u" * 257}):
        r = await gw.client.post("/v1/chat/completions", headers=h, json=body | bad)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(next(iter(bad))), r.text
