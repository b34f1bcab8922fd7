"""One tenant never takes the server from another: against a real ``kvgate serve`` (process engine, uvloop,
TLS) on the default model, a victim tenant's greedy stream keeps its pace while an attacker tenant keeps
two requests in flight that use one per-request feature at its worst (``hostile.ATTACKS``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from . import hostile
from .served import Served, serve

# The server's start (minutes on a loaded 2-core machine) counts against the first test.
pytestmark = pytest.mark.timeout(600)

VICTIM_TOKENS = 200
MAX_GAP_S = 1.0        # the victim's longest wait between two chunks
MIN_SHARE = 0.5        # of the tokens/s it has alone
# A victim still streaming after 4x its time alone (at least 20 s) is cut off: it has failed anyway. At
# most 150 s, so that a test (the first one's server start included) ends within its timeout.
MIN_DEADLINE_S, MAX_DEADLINE_S = 20.0, 150.0
# A stream's error event from the server's side (a 5xx's body: ``engine_unavailable``, ``request_failed``),
# as the gateway writes it; a request refused for its own input is an ``invalid_request_error``.
SERVER_ERROR = '"type":"server_error"'
GRAMMAR_ATTACKS = {"regex_a1000x1000", "regex_fresh", "regex_ab500x500", "json_schema_pattern",
                   "grammar_ambiguous"}
# What the victim keeps of its pace is asserted for the grammar attacks (a grammar's masks ran inside the
# shared step, so a grammar could freeze it). The other features' per-row work is bounded in the engine
# (tests/engine/test_penalties.py, the sampler's cut and the schema caps) and any hold would show as a gap,
# which is checked; their cost to the victim's pace is the attacker's volume: two more streams (three rows
# for one: 52-64% of the victim's pace alone on 2026-11-28, 2 cores), n=8 with top_logprobs (16 rows:
# 15-19%), n=8 with a top-p near 1 (16 rows whose cut ranks the whole vocabulary: 15%, as any 16 rows;
# 6% while that ranking was torch's full sort), or 128 tools at the body cap (the gateway's CPU admitting
# them: 36-48%). On a CPU every row costs step time: the time share holds each step to its time target
# (engine/sched/time_share.py), and the victim's pace under a crowd is then that step's, not its pace
# alone; per-tenant admission CPU is not bounded yet. The figures are printed for each run.
# Not run here: two long-context n=8 requests with penalties (hostile.ATTACKS["penalties_long_n8"]) keep
# 16 rows of 8k tokens and their prefill chunks in every step; with nothing to bound a tenant's share of a
# step's time, the victim's 200 tokens take longer than any deadline this suite can afford (none in 20 s
# on 2026-11-28). The per-row penalty cost itself is bounded (tests/engine/test_penalties.py).
# Nor, for the same want, an attacker keeping two long prompts no cache holds in flight: ~6k tokens each
# (hostile.ATTACKS["long_prompts_uncached"]; "prompt_logprobs_long" is one too, since such a prompt never
# reads the cache). On 2026-11-28 the victim had no first token in 20 s beside either: a 6k prompt takes
# ~15 s of the engine, its attention growing with the context, while the time share prices a prefill
# token the same at any depth. What a chunk costs must grow with its context before these can pass.
UNBOUNDED_YET = {"penalties_long_n8", "long_prompts_uncached", "prompt_logprobs_long"}
CHECKED_ATTACKS = [a for a in hostile.ATTACKS if a not in UNBOUNDED_YET]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory,
           default_model_dir: Path) -> Iterator[tuple[Served, tuple[str, str], str]]:
    """``make serve``'s server but for the determinism modes: batch_invariant's start-up proof of its
    kernels takes most of a start, and no request here asks for it."""
    data_dir = tmp_path_factory.mktemp("hostile")
    with serve(data_dir, default_model_dir, "--determinism-modes", "fast") as served:
        keys = served.make_key("victim"), served.make_key("attacker")
        r = httpx.get(f"{served.base}/v1/models", verify=str(served.ca),
                      headers={"Authorization": f"Bearer {keys[0]}"})
        yield served, keys, r.json()["data"][0]["id"]


def _outages(log: hostile.AttackLog) -> list[str]:
    """The attacker's replies that were a server error rather than its own request's: a 5xx, a dropped
    connection, or a stream's error event of a 5xx."""
    bad = [f"status {s}" for s in log.statuses if s >= 500 or s < 0]
    return bad + [e for e in log.error_events if SERVER_ERROR in e]


@pytest.mark.parametrize("attack", CHECKED_ATTACKS)
def test_a_victims_stream_keeps_its_pace_under_attack(server, attack):
    served, keys, model = server
    base, ca = served.base, str(served.ca)
    solo = asyncio.run(hostile.alone(base, ca, keys[0], model, VICTIM_TOKENS, 120))
    print(f"{attack}: alone {solo.describe()}")
    assert solo.result.error is None and solo.result.num_completion_tokens == VICTIM_TOKENS, solo.describe()
    deadline = min(MAX_DEADLINE_S, max(MIN_DEADLINE_S, 4 * solo.result.latency_s))
    run, log = asyncio.run(hostile.under_attack(base, ca, keys, model, attack, VICTIM_TOKENS, deadline))
    summary = f"{attack}: attacked {run.describe()}; attacker {log.statuses[:8]}"
    print(summary)
    assert run.result.error is None and run.result.num_completion_tokens == VICTIM_TOKENS, summary
    assert run.max_gap_s <= MAX_GAP_S, summary
    if attack in GRAMMAR_ATTACKS:
        assert run.tokens_per_s >= MIN_SHARE * solo.tokens_per_s, summary
    assert log.statuses, "the attacker sent nothing"
    assert not _outages(log), (_outages(log)[:3], log.bodies[:3])
    if attack in GRAMMAR_ATTACKS:  # refused at the door or run to the end: either way the request's own
        assert all(s in (200, 400) for s in log.statuses), (log.statuses, log.bodies[:3])
        assert not [b for b in log.bodies if '"param":null' in b], log.bodies[:3]  # a 400 names the field
    assert len(log.health) >= 2 and all(h == 200 for h in log.health), log.health
