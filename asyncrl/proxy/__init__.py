"""OpenAI-compatible proxy that turns any agent program into RL training data.

An agent talks to `ProxyServer` through the ordinary OpenAI API with a per-session key; the proxy
forwards each request to an inference engine, records the exact prompt ids, output ids, logprobs
and policy versions of every completion, and, once the agent returns its reward, exports the
session as training samples (`AgentWorkflow` does all of this for one episode).
"""
