"""The inference server as clients see it: a real `asyncrl serve` process on 127.0.0.1, the real
`openai` SDK, raw httpx for token-level and malformed requests."""

import asyncio
import json

import httpx
import openai
import pytest
from conftest import running_servers
import torch

from asyncrl.api import GenerationConfig, ModelRequest
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.inference.weight_buckets import push_weights_over_http
from asyncrl.models.loading import load_causal_lm, load_tokenizer

KEY = "test-admin-key"
CTX = 128


@pytest.fixture(scope="module")
def server(model_dir):
    args = ["--api-key", KEY, f"engine.max_seq_len={CTX}", "engine.max_num_seqs=16",
            "max_body_bytes=65536"]
    with running_servers(model_dir, 1, *args) as [(url, _)]:
        yield url


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    """In-process engine on the same weights: what each request must return when run alone."""
    return LLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=CTX, max_num_seqs=1))


def greedy_alone(reference, ids, n):
    req = ModelRequest(input_ids=ids, gconfig=GenerationConfig(greedy=True, max_new_tokens=n))
    return reference.generate([req])[0].output_tokens


def post(server, path, key=KEY, **kw):
    """POST with the server's API key (every route but health/version/metrics needs it)."""
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **kw.pop("headers", {})}
    return httpx.post(server + path, timeout=60, headers=headers, **kw)


def test_health_version_models_metrics(server):
    assert post(server, "/generate", json={"input_ids": [5, 6], "max_new_tokens": 2}).status_code == 200
    assert httpx.get(server + "/health").json()["status"] == "ok"
    assert httpx.get(server + "/version").json()["version"] == 0
    models = openai.OpenAI(base_url=server + "/v1", api_key=KEY).models.list()
    assert models.data[0].id == "default"
    text = httpx.get(server + "/metrics").text
    for name in ("asyncrl_queue_length", "asyncrl_running_requests", "asyncrl_kv_cache_usage",
                 "asyncrl_generation_tokens_per_second", "asyncrl_weight_version"):
        assert name in text


def test_generate_is_token_exact(server, reference):
    ids = [10, 20, 30, 40]
    body = {"input_ids": ids, "max_new_tokens": 12, "greedy": True}
    out = post(server, "/generate", json=body).json()
    assert out["output_tokens"] == greedy_alone(reference, ids, 12)
    assert len(out["output_logprobs"]) == len(out["output_tokens"]) == len(out["output_versions"])
    assert set(out["output_versions"]) == {0} and out["stop_reason"] in ("stop", "length")


@pytest.mark.parametrize("interval", [1, 5])
def test_streamed_generate_sends_an_event_per_interval_and_the_rest_last(server, interval):
    body = {"input_ids": [10, 20, 30], "max_new_tokens": 12, "min_new_tokens": 12,
            "greedy": True}
    whole = post(server, "/generate", json=body).json()
    with httpx.stream("POST", server + "/generate", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={**body, "stream": True, "stream_interval": interval}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    *deltas, last = events
    assert all(len(e["output_tokens"]) >= interval for e in deltas) and last["stop_reason"]
    assert len(deltas) >= (12 // interval) - 1  # the finishing step's tokens come last
    got = [t for e in events for t in e["output_tokens"]]
    assert got == whole["output_tokens"]
    assert [x for e in events for x in e["output_logprobs"]] == \
        pytest.approx(whole["output_logprobs"], abs=1e-5)


def test_openai_sdk_completions_and_chat(server, tokenizer):
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY)
    comp = client.completions.create(model="default", prompt="12+34=", max_tokens=5,
                                      temperature=0, logprobs=1)
    choice = comp.choices[0]
    assert choice.finish_reason in ("stop", "length") and len(choice.logprobs.token_logprobs) >= 1
    assert comp.usage.prompt_tokens == len(tokenizer.encode("12+34=", add_special_tokens=False))
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0.7, seed=1, n=3, logprobs=True)
    assert len(chat.choices) == 3
    for c in chat.choices:
        assert c.message.role == "assistant" and c.logprobs.content is not None
        assert all(t.logprob <= 0 for t in c.logprobs.content)
    again = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0.7, seed=1, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in chat.choices]


def test_openai_streaming_matches_non_streaming(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY)
    kwargs = dict(model="default", messages=[{"role": "user", "content": "7*6="}], max_tokens=10,
                  temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    comp_stream = client.completions.create(model="default", prompt="abc", max_tokens=8,
                                            temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in comp_stream)
    plain = client.completions.create(model="default", prompt="abc", max_tokens=8, temperature=0)
    assert streamed == plain.choices[0].text


def test_ignorable_openai_fields_are_accepted_and_change_nothing(server):
    """store, metadata, cache hints and neutral values (what agent SDKs send) give the same reply."""
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY)
    kwargs = dict(model="default", messages=[{"role": "user", "content": "7*6="}], max_tokens=6,
                  temperature=0)
    plain = client.chat.completions.create(**kwargs)
    extra = client.chat.completions.create(
        **kwargs, store=True, metadata={"run": "r1"}, prompt_cache_key="k",
        prompt_cache_retention="24h", safety_identifier="u1", verbosity="medium",
        tool_choice="auto", parallel_tool_calls=False, frequency_penalty=0.0,
        tools=[{"type": "function", "function": {"name": "calc", "parameters": {
            "type": "object", "properties": {"expr": {"type": "string"}}}}}])
    assert plain.choices[0].message.content is not None
    assert extra.choices[0].message.content is not None
    no_tools = client.chat.completions.create(**kwargs, store=False, metadata={"a": "b"})
    assert no_tools.choices[0].message.content == plain.choices[0].message.content


def test_stream_usage_chunk_when_asked(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY)
    kwargs = dict(model="default", messages=[{"role": "user", "content": "7*6="}], max_tokens=7,
                  temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.usage is None for c in client.chat.completions.create(stream=True, **kwargs))
    comp = client.completions.create(model="default", prompt=["ab", "cde"], max_tokens=5, n=2,
                                     temperature=0)
    comp_chunks = list(client.completions.create(
        model="default", prompt=["ab", "cde"], max_tokens=5, n=2, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}))
    assert comp_chunks[-1].choices == [] and comp_chunks[-1].usage == comp.usage


def test_async_openai_client(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY)
        outs = await asyncio.gather(*(client.completions.create(
            model="default", prompt=f"{i}+1=", max_tokens=4, temperature=0) for i in range(8)))
        return [o.choices[0].text for o in outs]
    assert len(asyncio.run(main())) == 8


def test_64_concurrent_clients_get_their_own_answers(server, reference):
    prompts = [[(7 * i + j) % 90 + 5 for j in range(3 + i % 11)] for i in range(64)]

    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=120,
                                     headers={"Authorization": f"Bearer {KEY}"}) as client:
            replies = await asyncio.gather(*(client.post("/generate", json={
                "input_ids": p, "max_new_tokens": 8, "greedy": True}) for p in prompts))
        return [r.json()["output_tokens"] for r in replies]

    got = asyncio.run(main())
    for p, out in zip(prompts, got):
        assert out == greedy_alone(reference, p, 8)


@pytest.mark.parametrize("path, body, status, needle", [
    ("/generate", {"input_ids": [1, 2], "bogus": 1}, 400, "bogus"),
    ("/generate", {"input_ids": "abc"}, 400, "input_ids"),
    ("/generate", {"input_ids": [1, 2], "max_new_tokens": "many"}, 400, "max_new_tokens"),
    ("/generate", {"input_ids": []}, 400, "empty"),
    ("/generate", {"input_ids": [1, 99999]}, 400, "out of range"),
    ("/generate", {"input_ids": [1] * 100, "max_new_tokens": 100}, 400, f"max_seq_len={CTX}"),
    ("/generate", {"input_ids": [1], "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 100}, 400, f"context length {CTX}"),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "empty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 1.0}, 400, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    # OpenAI fields the server cannot honour: a 400 naming the field and what is allowed
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice='required'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": {
        "type": "function", "function": {"name": "calc"}}}, 400, "allowed: 'auto', 'none'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "reasoning_effort": "low"}, 400, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "verbosity": "high"}, 400, "allowed: 'medium'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {}}}, 400, "response_format.type='json_schema'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                              "stream_options": {"bogus": True}}, 400, "stream_options.bogus"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "yes"}}, 400,
     "must be a bool"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "service_tier": "flex"}, 400, "service_tier"),
])
def test_bad_input_gets_4xx_json_and_server_keeps_serving(server, path, body, status, needle):
    resp = post(server, path, json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert needle in err["message"], err
    assert post(server, "/generate", json={"input_ids": [3], "max_new_tokens": 1}).status_code == 200


def test_oversized_and_malformed_bodies(server):
    big = post(server, "/generate", content=b'{"input_ids": [' + b"1," * 40000 + b"1]}",
               headers={"Content-Type": "application/json"})
    assert big.status_code == 413 and "limit" in big.json()["error"]["message"]
    bad = post(server, "/generate", content=b"{not json", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400
    assert httpx.get(server + "/health").status_code == 200


def test_control_endpoints_need_the_bearer_token(server):
    for path in ("/pause", "/resume", "/abort", "/update_weights"):
        assert post(server, path, key=None).status_code == 401
        assert post(server, path, key="wrong").status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert post(server, "/pause", headers=auth).json()["paused"] is True
    assert post(server, "/resume", headers=auth).json()["paused"] is False
    assert post(server, "/abort", headers=auth, json={}).status_code == 200


def test_weight_updates_from_disk_and_http_buckets(server, model_dir, tmp_path):
    auth = {"Authorization": f"Bearer {KEY}"}
    ids = [11, 12, 13]
    body = {"input_ids": ids, "max_new_tokens": 6, "greedy": True}
    before = post(server, "/generate", json=body).json()
    model = load_causal_lm(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(tmp_path / "w1")
    resp = post(server, "/update_weights", headers=auth, json={"path": str(tmp_path / "w1"),
                                                              "version": 1})
    assert resp.json()["version"] == 1
    after = post(server, "/generate", json=body).json()
    assert after["output_versions"] == [1] * len(after["output_tokens"])
    assert (after["output_tokens"], after["output_logprobs"]) != (before["output_tokens"],
                                                                   before["output_logprobs"])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    reply = push_weights_over_http(server, model.state_dict().items(), version=2,
                                   bucket_bytes=20_000, api_key=KEY)
    assert reply["version"] == 2 and reply["staged_tensors"] >= len(list(model.parameters()))
    pushed = post(server, "/generate", json=body).json()
    assert set(pushed["output_versions"]) == {2}
    assert pushed["output_logprobs"] != after["output_logprobs"]
    bad = post(server, "/update_weights/tensors", headers=auth, params={"version": 3, "bucket": 0},
               content=b"garbage")
    assert bad.status_code == 400 and "safetensors" in bad.json()["error"]["message"]
