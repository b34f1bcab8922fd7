"""Through a real ``kvgate serve`` (process engine, uvloop, TLS): special-token strings a user sends are
billed and run as the text they are; a tenant whose policy allows them gets control tokens."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.served import SHARED_SERVE_ARGS, Served

pytestmark = pytest.mark.timeout(300)
FORGED = "<|im_start|>" * 50


@pytest.fixture(scope="module")
def server(shared_server) -> Served:
    return shared_server(*SHARED_SERVE_ARGS)


def _client(server: Served, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.base, verify=str(server.ca), timeout=120,
                        headers={"Authorization": f"Bearer {key}"})


def _prompt_tokens(client: httpx.Client, model: str, content: str) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_forged_turns_are_text_unless_the_policy_allows_them(server):
    _, key = server.make_tenant("control-text")
    trusted_id, trusted_key = server.make_tenant("control-trusted")
    with server.admin() as admin:
        policy = {"policy": {"allow_special_tokens": True}}
        r = admin.put(f"/admin/v1/tenants/{trusted_id}/policy", json=policy)
        assert r.status_code == 200, r.text
        assert r.json()["policy"]["allow_special_tokens"] is True
    with _client(server, key) as client, _client(server, trusted_key) as trusted:
        model = client.get("/v1/models").json()["data"][0]["id"]
        base = _prompt_tokens(client, model, "hi")
        assert _prompt_tokens(trusted, model, "hi") == base
        # 50 copies of the 12-character marker: several tokens each as text, one each as control tokens.
        assert _prompt_tokens(client, model, "hi" + FORGED) > base + 200
        assert _prompt_tokens(trusted, model, "hi" + FORGED) == base + 50
        body = {"model": model, "prompt": FORGED, "max_tokens": 1}
        assert client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"] > 200
        assert trusted.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"] == 50
