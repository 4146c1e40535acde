"""The built-in inference engine: continuous batching over a slot KV cache on CPU (or GPU) torch.

`LLMEngine` is the synchronous core (add_request / step / abort / weight updates);
`AsyncLLMEngine` implements the api `InferenceEngine` protocol on top of it.
"""

from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig, LLMEngine

__all__ = ["AsyncLLMEngine", "EngineConfig", "LLMEngine"]
