"""kvgate's inference engine: paged KV cache, continuous batching, chunked prefill, prefix cache."""

from engine.config import EngineConfig
from engine.core import LLMEngine
from engine.errors import (
    InvalidRequestError,
    InvalidSamplingParamsError,
    ModelLoadError,
    PromptTooLongError,
    StructuredOutputError,
)
from engine.front.client import AsyncLLMEngine
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from engine.protocol import EngineClient, EngineRequest, ServedModel
from engine.request import SamplingParams
from engine.sched.fair import TenantShare
from engine.stats import EngineStats
from engine.structured import StructuredOutput

__all__ = ["AsyncLLMEngine", "CompletionOutput", "EngineClient", "EngineConfig", "EngineRequest",
           "EngineStats", "InvalidRequestError", "InvalidSamplingParamsError", "LLMEngine", "ModelLoadError",
           "PromptTooLongError", "RequestMetrics", "RequestOutput", "SamplingParams", "ServedModel",
           "StructuredOutput", "StructuredOutputError", "TenantShare", "TokenLogprobs"]
