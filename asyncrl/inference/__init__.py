"""The built-in inference engine: continuous batching over a slot KV cache on CPU (or GPU) torch.

`LLMEngine` is the synchronous core (add_request / step / abort / weight updates);
`AsyncLLMEngine` implements the api `InferenceEngine` protocol on top of it;
`RemoteInferenceEngine` implements it over N HTTP servers (ours, vLLM, SGLang).
"""

from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.inference.remote import RemoteEngineConfig, RemoteInferenceEngine

__all__ = ["AsyncLLMEngine", "EngineConfig", "LLMEngine", "RemoteEngineConfig",
           "RemoteInferenceEngine"]
