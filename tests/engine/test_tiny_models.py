"""Tiny random Llama (GQA, MHA), Mistral and Qwen2 (QKV bias): logits match transformers."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.testing import make_tiny_model_dir

CASES = [("llama", 4, 2), ("llama", 4, 4), ("mistral", 4, 1), ("qwen2", 4, 2)]


@pytest.mark.parametrize(("arch", "heads", "kv_heads"), CASES)
@pytest.mark.parametrize("chunk", [512, 8])
def test_prefill_and_decode_logprobs_match_transformers(tmp_path_factory, arch, heads, kv_heads, chunk):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir(tmp_path_factory.mktemp(f"{arch}{heads}{kv_heads}"), arch, num_heads=heads,
                               num_kv_heads=kv_heads, seed=heads + kv_heads)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64,
                                    max_num_batched_tokens=chunk, enable_prefix_caching=False))
    prompts = [[(7 * i + 3) % 4000 + 100 for i in range(n)] for n in (5, 23, 61)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=20)
    results = engine.generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for prompt, res in zip(prompts, results, strict=True):
        full = torch.tensor([prompt + res.token_ids])
        with torch.inference_mode():
            ref = torch.log_softmax(hf(full).logits[0].float(), -1)
        for step, lp in enumerate(res.logprobs):
            row = ref[len(prompt) - 1 + step]  # step 0: prefill logits; later: decode steps
            assert lp.token_id == int(row.argmax()) or abs(row.max() - row[lp.token_id]) < 1e-4
            ids = torch.tensor(list(lp.top))
            torch.testing.assert_close(torch.tensor(list(lp.top.values())), row[ids], atol=2e-4, rtol=1e-4)


def test_tied_and_untied_heads_load(tmp_path):
    for arch, tied in (("llama", True), ("qwen2", False)):
        path = make_tiny_model_dir(tmp_path / arch, arch)
        engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=16))
        assert (engine.loaded.model.lm_head is None) == tied


def test_one_row_logits_match_the_batched_head(tmp_path):
    """One sampled row goes through the transposed head copy; it agrees with the usual matmul."""
    for arch in ("llama", "qwen2"):  # tied and untied heads
        path = make_tiny_model_dir(tmp_path / arch, arch)
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16))
        model = engine.loaded.model
        assert model.head_t is not None and model.head_t.shape == (64, 49152) and model.head_t.is_contiguous()
        hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            batched = model.compute_logits(hidden)
            for i in range(3):
                one = model.compute_logits(hidden[i:i + 1])
                assert one.dtype == torch.float32 and one.shape == (1, 49152)
                torch.testing.assert_close(one[0], batched[i], rtol=1e-5, atol=1e-5)


def test_half_precision_keeps_no_transposed_head(tmp_path):
    engine = LLMEngine(EngineConfig(model=str(make_tiny_model_dir(tmp_path / "m")), dtype="bfloat16",
                                    num_kv_blocks=16))
    assert engine.loaded.model.head_t is None
