"""Overlapped decode steps (``EngineConfig.overlap_steps``): the next decode step's forward pass is
launched before the previous step's tokens are recorded. Run on the CPU through the CUDA decoder's eager
path (``test_cuda_decode._with_decoder``): every request must end with the tokens, text, logprobs and
finish reason of an engine that records each step before the next, with no block leaked."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.engine.test_cuda_decode import _with_decoder

_PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 40)), [9] * 17, [11, 12, 13]]


def _spy_launches(llm, seen=lambda seqs: len(seqs)) -> list:
    """What ``seen`` says at each step launched ahead (by default its row count)."""
    launched: list = []
    launch = llm.runner.launch_ahead
    llm.runner.launch_ahead = lambda seqs, pending: launched.append(seen(seqs)) or launch(seqs, pending)
    return launched


def _engine(factory, overlap: bool, **config):
    llm = factory(determinism_modes=("fast",), num_kv_blocks=96, overlap_steps=overlap, **config)
    _with_decoder(llm, [])
    return llm, _spy_launches(llm)


def _run(llm, script: dict[int, list], max_calls: int = 400) -> dict[str, object]:
    """Step until idle, applying ``script[call]`` (("add", id, prompt, params) or ("abort", id)) first;
    every request's final output by id."""
    final: dict[str, object] = {}
    for call in range(max_calls):
        for action in script.get(call, []):
            if action[0] == "add":
                llm.add_request(action[2], action[3], action[1])
            else:
                out = llm.abort(action[1])
                if out is not None:
                    final[action[1]] = out
        if call > max(script) and not llm.has_unfinished():
            return final
        for out in llm.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("the engine did not finish")


def _assert_clean(llm) -> None:
    pool = llm.kv.pool
    assert llm.scheduler.num_unfinished == 0 and llm._held is None
    assert pool.num_free_blocks == llm.loaded.num_blocks
    null = llm.runner.null_block
    assert all(not k[null].any() and not v[null].any() for k, v in llm.runner.kv_caches)


def _params(reference) -> dict[str, SamplingParams]:
    """A mix that stops every way: stop token, stop string, length, and none before max_tokens; seeded
    draws, penalties and logit_bias (which read the tokens recorded just before), logprobs, n=2."""
    stop_token = reference.token_ids[3]
    stop_text = reference.text[len(reference.text) // 2:][:2] or "e"
    return {
        "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
        "stop-token": SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token]),
        "stop-text": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop_text]),
        "short": SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        "seeded": SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, ignore_eos=True, seed=11),
        "plain-draw": SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=5, logprobs=1),
        "penalized": SamplingParams(temperature=0.7, max_tokens=18, ignore_eos=True, seed=3,
                                    frequency_penalty=1.5, presence_penalty=0.5, logit_bias={5: 3.0}),
        "two": SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=9, n=2),
    }


def _compare(a, b) -> None:
    assert a.finish_reason == b.finish_reason
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert x.token_ids == y.token_ids
        assert x.text == y.text
        assert x.finish_reason == y.finish_reason
        if y.logprobs is not None:
            assert [lp.token_id for lp in x.logprobs] == [lp.token_id for lp in y.logprobs]
            assert [lp.logprob for lp in x.logprobs] == pytest.approx([lp.logprob for lp in y.logprobs],
                                                                      abs=1e-4)


def test_overlapped_steps_give_every_request_what_stepping_in_turn_gives(tiny_engine_factory):
    ref, launched_ref = _engine(tiny_engine_factory, overlap=False)
    probe = ref.generate([_PROMPTS[1]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    params = _params(probe)
    # all at once, then arrivals and an abort while decode steps run ahead
    prompts = {"stop-token": _PROMPTS[1], "stop-text": _PROMPTS[1]}  # the probe's prompt: they do stop
    script = {0: [("add", name, prompts.get(name, _PROMPTS[i % len(_PROMPTS)]), p)
                  for i, (name, p) in enumerate(params.items())],
              5: [("add", "late", _PROMPTS[2], SamplingParams(temperature=0, max_tokens=10,
                                                              ignore_eos=True))],
              9: [("abort", "greedy")]}
    expected = _run(ref, script)
    llm, launched = _engine(tiny_engine_factory, overlap=True)
    got = _run(llm, script)
    assert not launched_ref and len(launched) > 12  # most decode steps ran ahead
    assert got.keys() == expected.keys() == set(params) | {"late"}
    for name in got:
        if name == "greedy":  # aborted: how far it got depends on when each engine recorded its tokens
            assert got[name].finish_reason == expected[name].finish_reason == "abort"
            continue
        _compare(got[name], expected[name])
    assert got["stop-token"].finish_reason == "stop" and got["stop-text"].finish_reason == "stop"
    for engine in (ref, llm):
        _assert_clean(engine)
    assert llm.stats().num_steps > 0


def test_no_step_runs_ahead_of_waiting_requests(tiny_engine_factory):
    """With more requests than ``max_num_seqs``, a decode step goes ahead only once nothing waits, so
    waiting requests are admitted as soon as they would be without overlap."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    script = {0: [("add", f"r{i}", _PROMPTS[i % 4], params) for i in range(6)]}
    ref, _ = _engine(tiny_engine_factory, overlap=False, max_num_seqs=2)
    expected = _run(ref, script)
    llm, launched = _engine(tiny_engine_factory, overlap=True, max_num_seqs=2)
    seen_waiting = _spy_launches(llm, lambda seqs: llm.scheduler.num_waiting)
    got = _run(llm, script)
    assert launched and not any(seen_waiting)
    for name in got:
        _compare(got[name], expected[name])
    _assert_clean(llm)


def test_a_failed_launch_ahead_steps_on_without_overlap(tiny_engine_factory, caplog):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    script = {0: [("add", f"r{i}", p, params) for i, p in enumerate(_PROMPTS)]}
    ref, _ = _engine(tiny_engine_factory, overlap=False)
    expected = _run(ref, script)
    llm, _ = _engine(tiny_engine_factory, overlap=True)
    calls = []

    def broken(seqs, pending):
        calls.append(len(seqs))
        raise RuntimeError("device lost")

    llm.runner.launch_ahead = broken
    got = _run(llm, script)
    assert len(calls) == 1  # tried once: the rest of the engine's life steps in turn
    assert "stepping in turn from now on" in caplog.text and "device lost" in caplog.text
    for name in got:
        _compare(got[name], expected[name])
    _assert_clean(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_overlapped_graph_steps_on_a_gpu(tiny_engine_factory):
    """The real thing: CUDA graphs replayed ahead while the host records (float32, so rounding leaves
    greedy and seeded tokens alone)."""
    config = {"device": "cuda", "dtype": "float32", "determinism_modes": ("fast",), "num_kv_blocks": 96}
    ref = tiny_engine_factory(**config, overlap_steps=False)
    probe = ref.generate([_PROMPTS[1]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    params = _params(probe)
    script = {0: [("add", name, _PROMPTS[1] if name.startswith("stop") else _PROMPTS[i % len(_PROMPTS)], p)
                  for i, (name, p) in enumerate(params.items())]}
    expected = _run(ref, script)
    llm = tiny_engine_factory(**config)
    launched = _spy_launches(llm)
    got = _run(llm, script)
    assert llm.runner.decoder.graphs_off is None and len(launched) > 12
    for name in got:
        _compare(got[name], expected[name])
    _assert_clean(llm)


def test_an_id_aborted_while_its_step_is_held_and_used_again_gets_only_its_own_tokens(tiny_engine_factory):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    script = {0: [("add", "a", _PROMPTS[0], params), ("add", "b", _PROMPTS[1], params)],
              4: [("abort", "a"), ("add", "a", _PROMPTS[2], params)]}
    ref, _ = _engine(tiny_engine_factory, overlap=False)
    expected = _run(ref, script)
    llm, launched = _engine(tiny_engine_factory, overlap=True)
    held = []
    step = llm.step
    llm.step = lambda: held.append(llm._held is not None) or step()
    got = _run(llm, script)
    assert held[4] and launched  # the abort came while a drawn step of "a" was held
    assert got["a"].prompt_token_ids == _PROMPTS[2] and len(got["a"].token_ids) == 8
    _compare(got["a"], expected["a"])  # text too: the held token must not reach the new request's text
    _compare(got["b"], expected["b"])
    _assert_clean(llm)
