"""Tiny randomly initialised Llama-family checkpoints for fast tests (real tokenizer, random weights), and
loaded weights reused under another KV pool."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.runner.kv_alloc import allocate_kv_caches, kv_dtype
from engine.runner.loader import resolve_model_dir
from engine.runner.setup import LoadedModel

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")


def make_tiny_model_dir(path: str | Path, arch: str = "llama", *, num_heads: int = 4, num_kv_heads: int = 2,
                        seed: int = 0, cache_dir: str | None = None,
                        tokenizer_dir: str | Path | None = None) -> Path:
    """Write a tiny random ``arch`` (llama, mistral or qwen2) HF checkpoint with the default model's
    tokenizer (its files from ``tokenizer_dir`` where given, for a machine without the default model).

    The vocabulary is the real one (49152 tokens), so chat templates and token counts behave as in
    production; everything else is small: 2 layers, hidden 64.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    source = Path(tokenizer_dir) if tokenizer_dir else resolve_model_dir(None, cache_dir)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                  pad_token_id=2)
    if arch == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
    elif arch == "mistral":
        config = MistralConfig(**common, tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None)
    elif arch == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1000000.0)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights give peaked, non-degenerate distributions
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif "bias" in "".join(n for n, q in model.named_parameters() if q is p):
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(path), safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    return path


def with_kv_pool(loaded: LoadedModel, config: EngineConfig) -> LoadedModel:
    """``loaded``'s weights and tokenizer with a zeroed pool of ``config.num_kv_blocks`` blocks of its own
    (and the null block), as ``load_model(config)`` would give them without loading the weights again.
    ``config`` must load the same weights: the same model, dtype and 4-bit options."""
    if config.num_kv_blocks is None:
        raise ValueError("with_kv_pool needs config.num_kv_blocks")
    mc = loaded.model_config
    shape = (config.num_kv_blocks + 1, config.block_size, mc.num_kv_heads, mc.head_dim)
    caches = allocate_kv_caches(config, shape, mc.num_layers, kv_dtype(config, loaded.dtype, loaded.device),
                                loaded.dtype, loaded.device)
    return dataclasses.replace(loaded, kv_caches=caches, num_blocks=config.num_kv_blocks)
