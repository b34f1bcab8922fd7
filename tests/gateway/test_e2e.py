"""End to end: `kvgate serve` over TLS on loopback, admin API over HTTPS, then the official openai SDK."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.settings import Settings

KVGATE = [sys.executable, "-c", "from gateway.cli import app; app()"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    data_dir = tmp_path_factory.mktemp("e2e-data")
    port = _free_port()
    env = os.environ | {"KVGATE_DATA_DIR": str(data_dir), "KVGATE_LOG_JSON": "true"}
    log = open(data_dir / "serve.log", "wb")
    proc = subprocess.Popen(
        [
            *KVGATE,
            "serve",
            "--port",
            str(port),
            "--model",
            str(tiny_model_dir),
            "--num-kv-blocks",
            "128",
            "--max-num-seqs",
            "4",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    ca = data_dir / "tls" / "ca.pem"
    base = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (data_dir / "serve.log").read_text()
            if ca.exists():
                try:
                    if httpx.get(f"{base}/readyz", verify=str(ca), timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            assert time.monotonic() < deadline, (data_dir / "serve.log").read_text()
            time.sleep(0.3)
        token = subprocess.run(
            [*KVGATE, "admin", "bootstrap"], env=env, check=True, capture_output=True, text=True
        ).stdout.strip()
        yield base, ca, token, data_dir, env
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_end_to_end_with_openai_sdk(server):
    base, ca, token, data_dir, env = server
    assert token.startswith("kvga_")
    log = (data_dir / "serve.log").read_text()
    assert "SHA-256 fingerprint" in log and str(ca) in log
    with pytest.raises(httpx.ConnectError):  # TLS is on: a client without the CA must not connect
        httpx.get(f"{base}/healthz", timeout=5)
    admin = httpx.Client(
        base_url=base, verify=str(ca), headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    tenant = admin.post("/admin/v1/tenants", json={"name": "e2e"}).json()
    key = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={"name": "sdk"}).json()["key"]
    client = openai.OpenAI(
        base_url=f"{base}/v1", api_key=key, http_client=httpx.Client(verify=str(ca)), max_retries=0
    )
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "hello, tell me about the sea and the stars " * 4}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
    assert chat.usage.prompt_tokens_details.cached_tokens == 0  # the tenant's first prompt
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage.completion_tokens == 4 and usage.prompt_tokens == chat.usage.prompt_tokens
    # The same prompt again: every full KV block before its last token comes from the prefix cache.
    block_size = Settings(data_dir=data_dir).engine_config().block_size
    num_cached = (usage.prompt_tokens - 1) // block_size * block_size
    assert num_cached >= 2 * block_size and usage.prompt_tokens_details.cached_tokens == num_cached
    text = client.completions.create(model=model, prompt="The sky is", max_tokens=3)
    assert text.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{base}/v1",
            api_key="kvg_0123456789abcdef_" + "z" * 43,
            http_client=httpx.Client(verify=str(ca)),
            max_retries=0,
        ).models.list()
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x " * 3000}])
    assert exc.value.code == "context_length_exceeded"
    metrics = admin.get("/metrics").text
    assert "kvgate_requests_total" in metrics and "kvgate_time_to_first_token_seconds_bucket" in metrics
    usage = admin.get(f"/admin/v1/tenants/{tenant['id']}/usage", params={"window": "day"}).json()
    assert usage[0]["num_requests"] == 3
    log = (data_dir / "serve.log").read_text()
    assert key not in log and key.split("_", 2)[2] not in log and token.split("_", 2)[2] not in log
    assert Path(data_dir / "pepper").stat().st_mode & 0o077 == 0


def test_client_disconnect_aborts_and_settles(server):
    """Closing the connection mid-stream aborts the engine request and settles only what was generated."""
    base, ca, token, _, _ = server
    admin = httpx.Client(
        base_url=base, verify=str(ca), headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    tenant = admin.post(
        "/admin/v1/tenants", json={"name": "disconnect", "policy": {"max_concurrent_requests": 1}}
    ).json()
    key = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={}).json()["key"]
    headers = {"Authorization": f"Bearer {key}"}
    model = httpx.get(f"{base}/v1/models", headers=headers, verify=str(ca)).json()["data"][0]["id"]
    req = {
        "model": model,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 1900,
        "stream": True,
        "temperature": 1.0,
    }
    with (
        httpx.Client(verify=str(ca), timeout=30) as c,
        c.stream("POST", f"{base}/v1/chat/completions", headers=headers, json=req) as r,
    ):
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    # the concurrency slot comes back once the aborted request has been settled
    deadline = time.monotonic() + 20
    while True:
        r = httpx.post(
            f"{base}/v1/chat/completions",
            headers=headers,
            verify=str(ca),
            timeout=30,
            json=req | {"stream": False, "max_tokens": 1},
        )
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text
    usage = admin.get(f"/admin/v1/tenants/{tenant['id']}/usage", params={"window": "day"}).json()[0]
    assert usage["num_requests"] == 2 and usage["completion_tokens"] < 1000
    assert "kvgate_engine_running_requests 0.0" in admin.get("/metrics").text
