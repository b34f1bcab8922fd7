"""The fused decode step (every layer of a few-row, decode-only step in one C++ call) against the same
arithmetic run op by op."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.testing import make_tiny_model_dir
from kernels import DecodeLayerWeights, fused_decode_layers

PROMPTS = ["a b c d e f g h i j k l", "one two three four five six seven", "the sea, the sea"]


def _engine(factory, fused: bool):
    return factory(dtype="bfloat16", int4_decode="on", fused_decode=fused, determinism_modes=("fast",))


def test_fused_steps_give_the_tokens_and_logprobs_of_the_op_by_op_layers(tiny_engine_factory, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    plain = _engine(tiny_engine_factory, False).generate(PROMPTS, params)
    fused_engine = _engine(tiny_engine_factory, True)
    calls: list[int] = []
    real = fused_decode_layers

    def counting(x, *args, **kw):
        calls.append(x.shape[0])
        return real(x, *args, **kw)

    monkeypatch.setattr("engine.models.llama.fused_decode_layers", counting)
    fused = fused_engine.generate(PROMPTS, params)
    assert calls and set(calls) <= {1, 2, 3}  # decode steps of 1-3 rows ran fused; prefills did not
    for a, b in zip(plain, fused, strict=True):
        assert a.token_ids == b.token_ids
        # the same bfloat16 roundings; only the order of RMSNorm's float32 sum differs
        gap = max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True))
        assert gap < 0.02, gap


def test_a_model_with_biases_decodes_layer_by_layer(tmp_path):
    from engine import EngineConfig, LLMEngine

    model_dir = make_tiny_model_dir(tmp_path / "qwen2", "qwen2")
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", int4_decode="on",
                                    num_kv_blocks=64, determinism_modes=("fast",)))
    assert engine.loaded.model.int4_max_rows == 8 and not engine.loaded.model.fused_decode
    out = engine.generate("a b c", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_a_slot_outside_the_pool_is_an_error_not_a_stray_write(tiny_engine_factory):
    model = _engine(tiny_engine_factory, True).loaded.model
    layer = model.layers[0]
    weights = DecodeLayerWeights([layer.input_norm.detach(), layer.post_norm.detach()],
                                 [layer.int4[p].packed for p in ("qkv", "o", "gate_up", "down")],
                                 [layer.int4[p].scales_zeros for p in ("qkv", "o", "gate_up", "down")])
    kv = torch.zeros(4, 16, layer.num_kv_heads, layer.head_dim)
    x = torch.randn(1, model.cfg.hidden_size).to(torch.bfloat16)
    cos = torch.ones(1, layer.head_dim, dtype=torch.bfloat16)
    rows = (torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long))
    heads = (layer.num_heads, layer.num_kv_heads, layer.head_dim)
    for slot in (-1, 64):
        with pytest.raises(RuntimeError, match="out of range"):
            fused_decode_layers(x, cos, cos, weights, [(kv, kv.clone())], torch.tensor([slot]), rows, heads,
                                layer.eps, layer.scale)
    out = fused_decode_layers(x, cos, cos, weights, [(kv, kv.clone())], torch.tensor([0]), rows, heads,
                              layer.eps, layer.scale)
    assert out.shape == x.shape and torch.isfinite(out.float()).all() and kv[0, 0].abs().sum() > 0
