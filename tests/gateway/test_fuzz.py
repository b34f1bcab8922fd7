"""Schemathesis against a real `kvgate serve` (TLS with its own CA, a tenant key and an admin token): every
operation of the whole OpenAPI document (/admin/v1/openapi.json), with inputs that fit its schema and
inputs that do not, answers no 5xx and only what the document says (status, content type, body), and the
server still serves afterwards.

A few examples per operation here; `make fuzz` runs many more (``KVGATE_FUZZ_EXAMPLES``) on fresh random
inputs (``KVGATE_FUZZ_RANDOM=1``; the suite's examples are the same on every run).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from .served import Served, serve

NUM_EXAMPLES = int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "20"))
IS_RANDOM = os.environ.get("KVGATE_FUZZ_RANDOM") == "1"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
REQUEST_TIMEOUT_S = 60


@dataclass
class Target:
    """The server, the credentials for each kind of route, and ids that exist (for path parameters)."""

    served: Served
    key: str
    model: str
    known: dict[str, str]
    schema: Any
    session: requests.Session

    def headers(self, path: str) -> dict[str, str]:
        is_tenants = path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
        token = self.key if is_tenants else self.served.admin_token
        return {"Authorization": f"Bearer {token}"}

    def call(self, case: Any) -> Any:
        return case.call_and_validate(base_url=self.served.base, session=self.session, checks=CHECKS,
                                      timeout=REQUEST_TIMEOUT_S, verify=str(self.served.ca))


def _known_ids(served: Served) -> dict[str, str]:
    """A tenant with a key, and an admin token, that the fuzzing may change (never the ones it uses)."""
    with served.admin() as admin:
        tenant_id = admin.post("/admin/v1/tenants", json={"name": "fuzz-target"}).json()["id"]
        key_id = admin.post(f"/admin/v1/tenants/{tenant_id}/keys", json={}).json()["info"]["id"]
        r = admin.post("/admin/v1/admin-tokens", json={"name": "fuzz-target", "scopes": ["admin:read"]})
    return {"tenant_id": tenant_id, "key_id": key_id, "token_id": r.json()["info"]["id"]}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Target]:
    data_dir = tmp_path_factory.mktemp("fuzz")
    with serve(data_dir, tiny_model_dir, "--num-kv-blocks", "64", "--max-num-seqs", "4",
               "--engine-thread") as served:
        _, key = served.make_tenant("fuzz")
        with httpx.Client(base_url=served.base, verify=str(served.ca), timeout=30) as client:
            models = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
            admin = {"Authorization": f"Bearer {served.admin_token}"}
            doc = client.get("/admin/v1/openapi.json", headers=admin).json()  # the whole document
        model = models["data"][0]["id"]
        with requests.Session() as session:
            known = {**_known_ids(served), "model_id": model}
            yield Target(served, key, model, known, schemathesis.openapi.from_dict(doc), session)


def _passes(operation: Any, known: dict[str, str]) -> Iterator[tuple[GenerationMode, dict[str, str] | None]]:
    """Valid inputs; invalid ones (where there is anything to get wrong); valid ones on ids that exist."""
    yield GenerationMode.POSITIVE, None
    if operation.path_parameters or operation.query or operation.body:
        yield GenerationMode.NEGATIVE, None
    fixed = {p.name: known[p.name] for p in operation.path_parameters if p.name in known}
    if fixed:
        yield GenerationMode.POSITIVE, fixed


def _fuzz(target: Target, operation: Any, mode: GenerationMode, fixed: dict[str, str] | None) -> None:
    @given(case=operation.as_strategy(generation_mode=mode, path_parameters=fixed))
    @settings(max_examples=NUM_EXAMPLES, derandomize=not IS_RANDOM, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    def run(case: Any) -> None:
        # The credentials of the route, never generated ones: failed authentications would get this
        # address throttled (429) for every later request.
        case.headers = {**(case.headers or {}), **target.headers(operation.path)}
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = target.model  # else nearly every completion is a 404
        target.call(case)

    run()


def _still_serves(target: Target) -> None:
    served = target.served
    assert served.proc.poll() is None, served.log()
    assert httpx.get(f"{served.base}/healthz", verify=str(served.ca), timeout=30).status_code == 200
    body = {"model": target.model, "prompt": "hello", "max_tokens": 2}
    r = httpx.post(f"{served.base}/v1/completions", json=body, headers=target.headers("/v1/"),
                   verify=str(served.ca), timeout=60)
    assert r.status_code == 200, r.text
    log = served.log()  # JSON lines: an unhandled error would be one at level error, with its traceback
    assert '"level":"error"' not in log and "Traceback" not in log, log[-4000:]


def test_every_operation_answers_what_the_document_says(target: Target) -> None:
    started, failures = time.monotonic(), []
    operations = [result.ok() for result in target.schema.get_all_operations()]
    assert len(operations) >= 28
    for operation in operations:
        for mode, fixed in _passes(operation, target.known):
            try:
                _fuzz(target, operation, mode, fixed)
            except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001  (every operation, then report)
                failures.append(f"{operation.method.upper()} {operation.path} ({mode.value}, {fixed}):\n{e}")
    assert not failures, "\n\n".join(failures)
    _still_serves(target)
    print(f"fuzzed {len(operations)} operations in {time.monotonic() - started:.0f} s")


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1}),
])
def test_a_streamed_completion_is_what_the_document_says(target: Target, path: str, body: dict) -> None:
    """The document described a stream's body as one string; schemathesis reads it as events, each an
    object whose data is a chunk (or [DONE])."""
    stream = {**body, "model": target.model, "max_tokens": 3, "stream": True,
              "stream_options": {"include_usage": True}}
    case = target.schema[path]["POST"].Case(body=stream, headers=target.headers(path),
                                           media_type="application/json")
    response = target.call(case)
    assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/event-stream")
