"""Tenants' fair share from their policies: what the engine is told, and the per-tenant figures in
/metrics (busy tenants only, by tenant id)."""

from __future__ import annotations

import asyncio

from engine import SamplingParams, TenantShare
from gateway.inference.admission import _share
from gateway.principal import Principal
from policies import Policy


async def test_a_policys_share_and_caps_reach_the_engine(gw):
    principal = Principal("tenant", "key-1", "tenant-1")
    total = gw.runtime.engine.stats().num_kv_blocks_total
    assert _share(gw.runtime, principal, Policy()) == TenantShare(b"tenant-1", 1.0, None)
    weighted = _share(gw.runtime, principal, Policy(share=3, max_kv_blocks=40))
    assert weighted == TenantShare(b"tenant-1", 3.0, 40)
    capped = _share(gw.runtime, principal, Policy(max_kv_blocks=10_000, max_kv_fraction=0.25))
    assert capped.max_kv_blocks == total // 4  # the smaller of the two caps


async def test_a_busy_tenant_shows_in_metrics_and_leaves_them_when_idle(gw):
    tid, key = await gw.make_tenant(policy=Policy(share=2))
    engine = gw.runtime.engine
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = engine.generate([5, 6, 7, 8], params, share=TenantShare(tid.encode(), 2.0))
    await anext(stream)
    text = (await gw.client.get("/metrics", headers=gw.admin())).text
    assert f'kvgate_tenant_running_requests{{tenant="{tid}"}} 1.0' in text
    assert f'kvgate_tenant_kv_blocks{{tenant="{tid}"}}' in text
    assert f'kvgate_tenant_step_share{{tenant="{tid}"}} 1.0' in text  # alone: every step is its own
    target = float(text.split("\nkvgate_engine_step_time_target_seconds ", 1)[1].split()[0])
    assert 0.005 < target < 5.0  # 2.5x the fixed cost this machine measured
    await stream.aclose()  # the caller leaves: the engine aborts it
    for _ in range(100):
        if not engine.stats().tenants:
            break
        await asyncio.sleep(0.05)
    text = (await gw.client.get("/metrics", headers=gw.admin())).text
    assert f'tenant="{tid}"' not in text.split("kvgate_tenant_running_requests", 1)[1].split("# HELP", 1)[0]


async def test_time_to_first_token_is_per_tenant(gw):
    tid, key = await gw.make_tenant()
    r = await gw.client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": gw.runtime.engine.model_name, "prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200, r.text
    text = (await gw.client.get("/metrics", headers=gw.admin())).text
    assert f'kvgate_time_to_first_token_seconds_count{{tenant="{tid}"}} 1.0' in text


async def test_the_admin_api_shows_a_tenants_place_in_the_engine(gw):
    tid, _ = await gw.make_tenant()
    engine = gw.runtime.engine
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = engine.generate([5, 6, 7, 9], params, share=TenantShare(tid.encode()))
    await anext(stream)
    r = await gw.client.get(f"/admin/v1/tenants/{tid}/engine", headers=gw.admin())
    assert r.status_code == 200 and r.json()["running"] == 1 and r.json()["kv_blocks"] >= 1, r.text
    await stream.aclose()
    assert (await gw.client.get("/admin/v1/tenants/nope/engine", headers=gw.admin())).status_code == 404


def test_the_prefix_cache_guarantee_reaches_the_engine(tmp_path):
    import pytest
    from pydantic import ValidationError

    from gateway.settings import Settings

    assert Settings(data_dir=tmp_path).engine_config().prefix_cache_guaranteed_fraction == 0.05
    config = Settings(data_dir=tmp_path, prefix_cache_guaranteed_fraction=0.2).engine_config()
    assert config.prefix_cache_guaranteed_fraction == 0.2 and config.guaranteed_blocks(100) == 20
    with pytest.raises(ValidationError):
        Settings(data_dir=tmp_path, prefix_cache_guaranteed_fraction=1.5)


async def test_recompute_and_eviction_counters_are_in_metrics(gw):
    s = gw.runtime.engine.stats()
    text = (await gw.client.get("/metrics", headers=gw.admin())).text
    for name, value in (("kvgate_engine_recomputed_tokens_total", s.num_recomputed_tokens),
                        ("kvgate_prefix_cache_evictions_total", s.num_cache_evictions),
                        ("kvgate_prefix_cache_guarded_evictions_total", s.num_guarded_evictions)):
        assert f"{name} {float(value)}" in text
