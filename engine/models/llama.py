"""Llama-family decoder (Llama, Mistral, Qwen2) over a flattened, unpadded token batch and a paged KV
cache."""

from __future__ import annotations

import torch
from torch import nn

from engine.determinism import Linear, TilePlan, TritonPlan, tiled_linear
from engine.errors import ModelLoadError
from engine.models.layers import PROJECTIONS, DecoderLayer, norm
from engine.runner.loader import ModelConfig
from kernels import (
    AttentionMetadata,
    DecodeLayerWeights,
    decode_kernel_loaded,
    decode_rows,
    fused_decode_layers,
    fused_dense_layers,
    int8,
)
from kernels.int4 import is_exact, pack_int4
from kernels.paged_attention import zero_block


class LlamaForCausalLM(nn.Module):
    """The model. ``forward`` returns hidden states; ``compute_logits`` only for the rows that sample."""

    def __init__(self, cfg: ModelConfig, max_model_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        # An explicit (uninitialized) weight: Embedding's own random init on the meta device imports
        # torch._dynamo (~1 s of every start), and the checkpoint overwrites it anyway.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.head_t: torch.Tensor | None = None  # see place_head()
        self.int4_max_rows = 0  # steps of at most this many tokens use the layers' 4-bit copies
        self.head_int8: int8.Int8Weight | None = None  # the LM head's 8-bit copy for as few rows
        self.fused_decode = False  # decode-only steps on the 4-bit copies run as one C++ call
        self._fused_weights: DecodeLayerWeights | None = None
        # Bigger decode-only steps (or any, without 4-bit copies) run as one C++ call on the dense weights
        self.fused_dense = False
        self._dense_weights: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.init_rope(max_model_len)

    def init_rope(self, max_model_len: int) -> None:
        """cos/sin for every position, in float32 as transformers computes them (cast at use)."""
        freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float32, device="cpu"), self.cfg.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * self.cfg.rope_attention_scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * self.cfg.rope_attention_scaling, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # input_ids, positions: [T] → hidden [T, hidden]
        x = self.embed(input_ids)
        cos = self.cos_cache[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(x.dtype).unsqueeze(1)
        use_int4 = meta.linear_plan is None and x.shape[0] <= self.int4_max_rows
        if (self.fused_decode if use_int4 else self.fused_dense) and self._can_fuse(x, meta, kv_caches):
            x = self._fused_forward(x, cos, sin, meta, kv_caches, use_int4)
            if meta.scratch_block is not None:  # padding rows wrote it in every layer: zero it again
                for k_cache, v_cache in kv_caches:
                    zero_block(k_cache, meta.scratch_block)
                    zero_block(v_cache, meta.scratch_block)
            return x
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, meta, kv, use_int4)
        return x

    def _can_fuse(self, x: torch.Tensor, meta: AttentionMetadata,
                  kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """A decode-only step of the fast path on the CPU, which the fused C++ layers run whole."""
        return (not meta.prefills and meta.invariant is None
                and meta.num_decode_tokens == x.shape[0] and x.dtype in (torch.bfloat16, torch.float32)
                and kv_caches[0][0].dtype in (torch.float32, torch.bfloat16) and decode_kernel_loaded())

    def _fused_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], use_int4: bool) -> torch.Tensor:
        first = self.layers[0]
        heads = (first.num_heads, first.num_kv_heads, first.head_dim)
        rows = decode_rows(meta, kv_caches[0][0].shape[1])
        if not use_int4:
            if self._dense_weights is None:
                self._dense_weights = (
                    [n.detach() for layer in self.layers for n in (layer.input_norm, layer.post_norm)],
                    [getattr(layer, p).weight.detach() for layer in self.layers for p in PROJECTIONS])
            return fused_dense_layers(x, cos[:, 0], sin[:, 0], *self._dense_weights, kv_caches,
                                      meta.slot_mapping, rows, heads, first.eps, first.scale)
        if self._fused_weights is None:
            self._fused_weights = DecodeLayerWeights(
                [n for layer in self.layers for n in (layer.input_norm.detach(), layer.post_norm.detach())],
                *([getattr(layer.int4[p], part) for layer in self.layers for p in PROJECTIONS]
                  for part in ("nibbles", "scales", "mins")))
        return fused_decode_layers(x, cos[:, 0], sin[:, 0], self._fused_weights, kv_caches, meta.slot_mapping,
                                   rows, heads, first.eps, first.scale)

    def pack_int4(self, max_rows: int, exact_only: bool) -> bool:
        """Keep a 4-bit copy of every layer's weights for steps of at most ``max_rows`` tokens (the model
        must be bfloat16 or float32 on the CPU). With ``exact_only``, keep them only if every weight was
        4-bit to begin with (a Q4 GGUF's), so the copies change nothing but the rounding of the scales.
        Returns whether the copies are in use."""
        packed = []
        for layer in self.layers:  # stops at the first weight that is not 4-bit, when only exact will do
            weights = {name: pack_int4(getattr(layer, name).weight, getattr(layer, name).bias)
                       for name in PROJECTIONS}
            if exact_only and not all(is_exact(w) for w in weights.values()):
                return False
            packed.append(weights)
        for layer, weights in zip(self.layers, packed, strict=True):
            layer.int4 = weights
        self.int4_max_rows = max_rows
        # the fused decode step has no bias terms: models with any (Qwen2's qkv) run layer by layer
        self.fused_decode = all(w.bias is None for weights in packed for w in weights.values())
        return True

    def pack_int8_head(self, exact_only: bool) -> bool:
        """Keep an 8-bit copy (groups of 32) of the LM head for the same few-row steps; with
        ``exact_only``, only if the head was 8-bit to begin with (a Q8_0 GGUF's). Whether it is in use."""
        head = int8.pack_int8(self._head_weight())
        if exact_only and not int8.is_exact(head):
            return False
        self.head_int8 = head
        return True

    def compute_logits(self, hidden: torch.Tensor, plan: TilePlan | TritonPlan | None = None) -> torch.Tensor:
        """hidden: [N, hidden] → float32 logits [N, vocab]."""
        h = norm(hidden, self.norm, self.cfg.rms_norm_eps, plan)
        if plan is None and self.head_int8 is not None and h.shape[0] <= self.int4_max_rows:
            return int8.int8_linear(h, self.head_int8)
        if plan is None and h.shape[0] == 1 and self.head_t is not None:
            return h @ self.head_t
        return tiled_linear(h, self._head_weight(), None, plan).float()

    def _head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def place_head(self) -> None:
        """On the CPU in float32, keep a [hidden, vocab] copy of the LM head for one-row logits.

        A one-row product over the [vocab, hidden] weight runs as vocab short dot products; over the
        transposed copy, BLAS streams the weight once: 2-6x faster for the LM head (the largest matrix, and
        a batch-1 decode step's biggest single cost). Two or more rows go through the usual matmul, which
        is as fast or faster on the original layout; half precision is much slower transposed. Costs one
        more copy of the head in memory (113 MB for SmolLM2-135M).
        """
        weight = self._head_weight()
        self.head_t = (weight.detach().t().contiguous()
                       if weight.device.type == "cpu" and weight.dtype == torch.float32 else None)

    def linears(self) -> tuple[list[Linear], list[Linear]]:
        """(weight, bias) of each matmul shape the forward pass runs, to plan and check batch-invariant
        tiles: those every token goes through, and the LM head, which runs on sampled rows only."""
        layer = self.layers[0]
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return [(m.weight, m.bias) for m in (layer.qkv, layer.o, layer.gate_up, layer.down)], [(head, None)]

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Fuse and copy transformers' parameter names into ours; every expected weight must be present."""
        own = {name: p for name, p in self.named_parameters()}
        mapped: dict[str, torch.Tensor] = {}
        get = _getter(state)
        mapped["embed.weight"] = get("model.embed_tokens.weight")
        mapped["norm"] = get("model.norm.weight")
        if self.lm_head is not None:
            mapped["lm_head.weight"] = get("lm_head.weight")
        for i in range(self.cfg.num_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            mapped[f"layers.{i}.input_norm"] = get(p + "input_layernorm.weight")
            mapped[f"layers.{i}.post_norm"] = get(p + "post_attention_layernorm.weight")
            mapped[f"layers.{i}.qkv.weight"] = torch.cat([get(a + f"{x}_proj.weight") for x in "qkv"])
            if self.cfg.qkv_bias:
                mapped[f"layers.{i}.qkv.bias"] = torch.cat([get(a + f"{x}_proj.bias") for x in "qkv"])
            mapped[f"layers.{i}.o.weight"] = get(a + "o_proj.weight")
            if self.cfg.o_bias:
                mapped[f"layers.{i}.o.bias"] = get(a + "o_proj.bias")
            mlp = p + "mlp."
            mapped[f"layers.{i}.gate_up.weight"] = torch.cat([get(mlp + "gate_proj.weight"),
                                                              get(mlp + "up_proj.weight")])
            mapped[f"layers.{i}.down.weight"] = get(mlp + "down_proj.weight")
        with torch.no_grad():
            for name, tensor in mapped.items():
                if own[name].shape != tensor.shape:
                    raise ModelLoadError(f"weight {name}: expected shape {tuple(own[name].shape)}, "
                                         f"got {tuple(tensor.shape)}")
                own[name].copy_(tensor)


def _getter(state: dict[str, torch.Tensor]):
    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ModelLoadError(f"checkpoint is missing weight {name!r}")
        return state[name]
    return get
