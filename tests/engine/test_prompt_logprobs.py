"""vLLM's prompt_logprobs: every prompt token's logprob, rank and top alternatives match transformers,
whatever the chunking, the prefix cache or the rows beside them."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

PROMPTS = [[(7 * i + 3) % 4000 + 100 for i in range(n)] for n in (37, 9)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1) for p in PROMPTS]


def _engine(tiny_llama_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64,
                                  determinism_modes=("fast",), **overrides))


def _check(prompt_logprobs, prompt, ref, k):
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for q in range(1, len(prompt)):
        lp, row = prompt_logprobs[q], ref[q - 1]
        assert lp.token_id == prompt[q] and abs(lp.logprob - float(row[prompt[q]])) < 2e-4
        assert lp.rank == int((row > row[prompt[q]]).sum()) + 1
        assert list(lp.top) == torch.topk(row, k).indices.tolist()


@pytest.mark.parametrize("chunk", [512, 8])
def test_prompt_logprobs_match_transformers(tiny_llama_dir, reference, chunk):
    engine = _engine(tiny_llama_dir, max_num_batched_tokens=chunk)
    out = engine.generate([PROMPTS], SamplingParams(temperature=0, max_tokens=2, n=2, prompt_logprobs=3))[0]
    assert sorted(out.prompt_logprobs) == [0, 1]
    for p, prompt in enumerate(PROMPTS):
        _check(out.prompt_logprobs[p], prompt, reference[p], 3)


def test_a_cached_prompt_is_computed_again(tiny_llama_dir, reference):
    engine = _engine(tiny_llama_dir)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    engine.generate([PROMPTS[0]], greedy)
    assert engine.generate([PROMPTS[0]], greedy)[0].num_cached_tokens > 0
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0  # no position of the prompt may be skipped
    _check(out.prompt_logprobs[0], PROMPTS[0], reference[0], 0)
    assert engine.generate([PROMPTS[0]], greedy)[0].prompt_logprobs is None


def test_neighbours_see_the_same_logits(tiny_llama_dir):
    """A row beside one that asks for prompt logprobs gets the same tokens and logprobs, to the bit."""
    outs = []
    for asked in (None, 5):
        engine = _engine(tiny_llama_dir)
        plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
        other = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=asked)
        engine.add_request(PROMPTS[1], plain, "plain")
        engine.add_request(PROMPTS[0], other, "other")
        final = {}
        while engine.has_unfinished():
            final |= {o.request_id: o for o in engine.step() if o.finished}
        outs.append(final)
    for rid in ("plain", "other"):
        assert outs[0][rid].token_ids == outs[1][rid].token_ids
    assert [(x.logprob, x.top) for x in outs[0]["plain"].logprobs] == [
        (x.logprob, x.top) for x in outs[1]["plain"].logprobs]


@pytest.mark.parametrize(("asked", "num_computed"), [(None, 16), (2, 8)])
def test_a_prompt_with_logprobs_counts_twice_in_the_step(tiny_llama_dir, asked, num_computed):
    engine = _engine(tiny_llama_dir, max_num_batched_tokens=16)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2, prompt_logprobs=asked), "r")
    engine.step()
    assert engine.requests["r"].seqs[0].num_computed_tokens == num_computed
