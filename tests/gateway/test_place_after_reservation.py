"""A request takes its engine place only once its reservation has decided. When the places went to other
tenants' requests meanwhile, it is answered at once (503) and settled as never run: its reserved tokens,
concurrency slot, gate hold and claim all given back, and its audit trail closed by a
``request.finished`` with no usage."""

from __future__ import annotations

from sqlalchemy import select

from gateway.limits.overload import EnginePlace
from gateway.storage.db import make_db_engine
from gateway.storage.models import UsageCounter
from policies import Policy

from .conftest import open_gateway, tenant_events


async def _minute_counters(db_url: str, tenant_id: str) -> tuple[int, int]:
    """The tenant's (tokens, requests) in the minute window's counter, read on this loop."""
    db = make_db_engine(db_url, null_pool=True)
    try:
        async with db.connect() as conn:
            row = (await conn.execute(
                select(UsageCounter.num_tokens, UsageCounter.num_requests)
                .where(UsageCounter.tenant_id == tenant_id, UsageCounter.window == "minute")
            )).one()
    finally:
        await db.dispose()
    return row.num_tokens, row.num_requests


def _filling_the_places(rt, reserve, others: list[EnginePlace]):  # type: ignore[no-untyped-def]
    """``reserve``, after which other tenants' requests take every place left (into ``others``)."""

    async def reserve_while_the_places_fill(*args, **kwargs):  # type: ignore[no-untyped-def]
        decided = await reserve(*args, **kwargs)
        while rt.overload.num_in_flight < rt.overload.limit:
            place = rt.overload.claim(f"other-{len(others)}")  # each under its share: it gets one
            place.take()
            others.append(place)
        return decided

    return reserve_while_the_places_fill


async def test_a_place_refused_once_reserved_is_settled_as_never_run(tmp_path, db_url, llm, monkeypatch):
    async for gw in open_gateway(tmp_path, db_url, llm):
        rt = gw.runtime
        tid, key = await gw.make_tenant(policy=Policy(max_concurrent_requests=1))
        reserve, others = rt.quota.reserve, []
        monkeypatch.setattr(rt.quota, "reserve", _filling_the_places(rt, reserve, others))
        body = {"model": rt.engine.model_name, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4}
        headers = {"Authorization": f"Bearer {key}"}
        r = await gw.client.post("/v1/chat/completions", headers=headers, json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_overloaded", r.text
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert rt.overload.num_places(tid) == (0, 0) and rt.quota.gate.num_in_flight(tid) == 0
        assert await _minute_counters(db_url, tid) == (0, 1)  # the tokens back; the request was admitted
        events = [(name, data) for name, _, data in await tenant_events(db_url, tmp_path, tid)]
        assert [name for name, _ in events] == ["auth.success", "request.admitted", "request.finished"]
        finished = events[-1][1]
        assert finished["status_code"] == 503 and finished["is_aborted"]
        assert finished["num_prompt_tokens"] == finished["num_completion_tokens"] == 0

        monkeypatch.setattr(rt.quota, "reserve", reserve)
        for place in others:
            place.give()
        r = await gw.client.post("/v1/chat/completions", headers=headers, json=body)
        assert r.status_code == 200, r.text  # its one concurrency slot was given back


def test_a_claim_is_given_back_once_whichever_way_its_request_ends() -> None:
    from gateway.limits.overload import EngineGate

    gate = EngineGate(num_running=1, max_queued=0)
    place: EnginePlace = gate.claim("t")
    place.give(is_finished=False)
    place.give()
    assert gate.num_places("t") == (0, 0)
    place = gate.claim("t")
    place.take()
    place.give()
    place.give(is_finished=False)
    assert gate.num_places("t") == (0, 0) and gate.num_in_flight == 0
