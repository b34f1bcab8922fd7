"""OpenAI's promise for ``seed``: the same request with the same seed and parameters returns the same
result. Through ``kvgate serve`` on the default model, as a client would see it: the second of two
identical seeded requests starts from the first's cached prefix blocks, and in ``fast`` mode its remaining
prompt rows are computed in a smaller matmul that rounds differently (its tokens parted from the first's
after one token on 2026-11-28). A seeded request that names no mode runs in its policy's seeded mode, here
``batch_invariant``, whose tokens do not depend on how its steps are cut."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from .served import Served, serve

REPEATS = {"seeded_determinism": "batch_invariant"}
MESSAGES = [{"role": "user", "content": "Write about the lighthouse keeper and the long winter sea. " * 6}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Served]:
    with serve(tmp_path_factory.mktemp("seeds"), default_model_dir) as served:  # every mode, as make serve
        yield served


def _client(served: Served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base}/v1", api_key=key, max_retries=0,
                         http_client=httpx.Client(verify=str(served.ca), timeout=120))


def _ask(client: openai.OpenAI, model: str, **fields: object):  # noqa: ANN202
    extra = {"extra_body": {"determinism": fields.pop("determinism")}} if "determinism" in fields else {}
    return client.chat.completions.create(model=model, messages=MESSAGES, temperature=0.9, **fields, **extra)


def test_a_seeded_request_repeats_its_output_whatever_the_prefix_cache_holds(server):
    client = _client(server, server.make_key("seeds", REPEATS))
    model = client.models.list().data[0].id
    runs = [_ask(client, model, max_tokens=48, seed=1234) for _ in range(3)]
    texts = [r.choices[0].message.content for r in runs]
    assert texts[0] == texts[1] == texts[2] and runs[0].usage.completion_tokens == 48
    assert runs[0].usage.prompt_tokens_details.cached_tokens == 0
    assert runs[1].usage.prompt_tokens_details.cached_tokens > 0  # the repeats started from the cache
    assert len({r.system_fingerprint for r in runs}) == 1


def test_a_named_mode_or_no_seed_keeps_the_mode_it_had(server):
    tenant, key = server.make_tenant("modes", REPEATS)
    client = _client(server, key)
    model = client.models.list().data[0].id
    seeded = _ask(client, model, max_tokens=2, seed=7).system_fingerprint
    fast = _ask(client, model, max_tokens=2, seed=7, determinism="fast").system_fingerprint
    assert fast != seeded  # named, the mode is the caller's
    assert _ask(client, model, max_tokens=2).system_fingerprint == fast  # no seed: the policy's default
    with server.admin() as admin:  # the default policy keeps seeded requests in its default mode
        r = admin.put(f"/admin/v1/tenants/{tenant}/policy", json={"policy": {}})
        assert r.is_success, r.text
    assert _ask(client, model, max_tokens=2, seed=7).system_fingerprint == fast
