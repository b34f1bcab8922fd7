"""Random-weight Llama checkpoints for `kvgate bench gpu`: the default model's architecture (or a larger
one) with seeded random weights, so the bench needs no downloaded weights on the measuring machine."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
# Architectures over the default model's config.json: "default" keeps it, the others override fields.
ARCHITECTURES: dict[str, dict] = {
    "default": {},
    # Two layers, hidden 64: a CPU dry run of the whole bench in seconds.
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16},
    # TinyLlama-1.1B's shape (GQA 32/4, head 64) with the default model's vocabulary: a size where the
    # GPU's matmuls, not the launch overhead, should dominate.
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 64, "tie_word_embeddings": False},
}
# Larger than transformers' default init (0.02): random logits then have clear winners, so greedy
# decoding is not a coin toss between near-ties that a last-bit difference would flip.
INIT_STD = 0.08
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAD = 2  # the default model's end-of-text id, as `kvgate bench engine` pads


def make_random_model(source: Path, out: Path, arch: str = "default", seed: int = 0,
                      dtype: torch.dtype = torch.float32, init_device: str = "cpu") -> Path:
    """Write a random-weight HF checkpoint of ``arch`` into ``out`` with ``source``'s tokenizer.

    Args:
        source: A model directory holding the default model's config.json and tokenizer files (its
            weights, if any, are not read).
        out: Where the checkpoint goes (created).
        arch: A key of ``ARCHITECTURES``.
        seed: Seeds the weights.
        dtype: The saved weights' dtype (bfloat16 halves a large model's write and read).
        init_device: Where the weights are drawn (a GPU draws a 1B model in a blink; the weights then
            differ from a CPU draw of the same seed).

    Returns:
        ``out``.
    """
    from transformers import AutoConfig, LlamaForCausalLM

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; known: {sorted(ARCHITECTURES)}")
    config = AutoConfig.from_pretrained(str(source), local_files_only=True)
    for key, value in ARCHITECTURES[arch].items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    with torch.device(init_device):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, INIT_STD)
    out.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(str(out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and not (out / name).exists():
            shutil.copy(source / name, out / name)
    return out


def default_source() -> Path:
    """The prepared default model directory (config and tokenizer; converted on first use)."""
    from engine.runner.loader import resolve_model_dir

    return resolve_model_dir(None)


def kvgate_engine(model_dir: Path, device: str, dtype: str, **overrides):
    """An LLMEngine over ``model_dir``: fast mode only unless overridden, a 4 GiB KV pool on a GPU."""
    from engine import EngineConfig, LLMEngine

    overrides.setdefault("determinism_modes", ("fast",))
    overrides.setdefault("kv_cache_memory", (4 << 30) if device == "cuda" else (1 << 30))
    return LLMEngine(EngineConfig(model=str(model_dir), device=device, dtype=dtype, **overrides))


def hf_model(model_dir: Path, device: str, dtype: str):
    """transformers' model of the same checkpoint, in ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype]).to(device).eval()


def free_memory(device: str) -> None:
    """Between peers: wait for the device, return cached blocks, restart the peak count."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gpu_mib(device: str) -> float | None:
    """Peak allocated GPU memory since the last ``free_memory`` (None off CUDA)."""
    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
