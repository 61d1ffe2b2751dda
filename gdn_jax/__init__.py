"""gdn-jax: exact prefix caching of recurrent state for Qwen3.5-style hybrid models, in JAX."""

from gdn_jax.config import PRESETS, EngineConfig, ModelConfig, get_preset
from gdn_jax.engine import LLM, CompletionOutput, EngineStepError, LLMEngine, Logprob, RequestMetrics, RequestOutput
from scheduler import LinearStateCacheOp, SamplingParams

__all__ = [
    "LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob", "EngineStepError",
    "LinearStateCacheOp", "EngineConfig", "ModelConfig", "PRESETS", "get_preset",
]
