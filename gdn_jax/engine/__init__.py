"""The engine: requests in, outputs out (`LLMEngine` step by step, `LLM` for whole batches)."""

from gdn_jax.config import EngineConfig
from gdn_jax.engine.llm import LLM
from gdn_jax.engine.llm_engine import LLMEngine
from gdn_jax.engine.outputs import (CompletionOutput, EngineFull, EngineStepError, Logprob, LogprobRow,
                                    RequestMetrics, RequestOutput)

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineFull", "EngineStepError", "LLMEngine", "Logprob",
           "LogprobRow", "RequestMetrics", "RequestOutput"]
