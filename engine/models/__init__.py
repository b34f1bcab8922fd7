"""Model implementations (one Llama-family module covers Llama, Mistral and Qwen2)."""

from engine.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
