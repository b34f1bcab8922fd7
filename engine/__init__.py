"""kvgate's inference engine: paged KV cache, continuous batching, chunked prefill, prefix cache."""

from engine.client import AsyncLLMEngine
from engine.config import EngineConfig
from engine.core import LLMEngine
from engine.errors import (
    InvalidRequestError,
    InvalidSamplingParamsError,
    ModelLoadError,
    PromptTooLongError,
    StructuredOutputError,
)
from engine.fair import TenantShare
from engine.protocol import EngineClient, EngineRequest
from engine.request import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, TokenLogprobs
from engine.stats import EngineStats
from engine.structured import StructuredOutput

__all__ = ["AsyncLLMEngine", "CompletionOutput", "EngineClient", "EngineConfig", "EngineRequest",
           "EngineStats", "InvalidRequestError", "InvalidSamplingParamsError", "LLMEngine", "ModelLoadError",
           "PromptTooLongError", "RequestMetrics", "RequestOutput", "SamplingParams", "StructuredOutput",
           "StructuredOutputError", "TenantShare", "TokenLogprobs"]
