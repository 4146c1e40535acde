"""Inference: the built-in engine, its HTTP server, and the remote client.

`engine.LLMEngine` is the synchronous core (add_request / step / abort / weight updates),
`async_engine.AsyncLLMEngine` implements the api `InferenceEngine` protocol on top of it,
`remote.RemoteInferenceEngine` implements it over N HTTP servers (ours, vLLM, SGLang) through
the backends of `backends.py`. Import from the modules: this package stays light to import.
"""
