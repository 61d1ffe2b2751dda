"""The engine: requests in, outputs out (`LLMEngine` step by step, `LLM` for whole batches)."""

from gdn_jax.engine.llm_engine import (LLM, CompletionOutput, EngineStepError, LLMEngine, Logprob, RequestMetrics,
                                       RequestOutput)

__all__ = ["LLM", "CompletionOutput", "EngineStepError", "LLMEngine", "Logprob", "RequestMetrics", "RequestOutput"]
