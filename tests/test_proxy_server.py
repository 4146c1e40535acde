"""The proxy over real HTTP with the real `openai` client (sync and async, streaming and not).

Sampling and recording run on the real built-in engine with the tiny model; tool-call replies
come from a scripted engine, because an untrained tiny model never writes a well-formed call.
"""

import asyncio
import time

import httpx
import openai
import pytest

from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig
from asyncrl.models.chat import encode_chat_prompt
from asyncrl.models.loading import load_tokenizer
from asyncrl.proxy.config import ProxyConfig
from asyncrl.rollout.staleness import StalenessManager
from tests.proxy_helpers import ScriptedEngine, serving

ADMIN = {"Authorization": "Bearer admin-secret"}
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic",
          "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]
MSGS = [{"role": "user", "content": "2+3="}]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def real(model_dir, tokenizer, one_thread):
    engine = AsyncLLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=256))
    cfg = ProxyConfig(admin_key="admin-secret", max_tokens_cap=32, max_n=4)
    with serving(engine, tokenizer, cfg, context_length=256) as (proxy, _):
        yield proxy
    engine.shutdown()


def start(proxy) -> dict:
    r = httpx.post(f"{proxy.url}/sessions", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def export(proxy, sid, style="individual", discount=1.0) -> list[dict]:
    r = httpx.post(f"{proxy.url}/sessions/{sid}/export", headers=ADMIN,
                   json={"style": style, "turn_discount": discount})
    assert r.status_code == 200, r.text
    return r.json()["samples"]


def client(proxy, key):
    return openai.OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)


def test_sync_chat_is_recorded_exactly(real, tokenizer):
    s = start(real)
    reply = client(real, s["api_key"]).chat.completions.create(
        model="default", messages=MSGS, max_tokens=5, n=2, temperature=1.0, seed=7)
    assert len(reply.choices) == 2 and reply.usage.completion_tokens <= 10
    samples = export(real, s["session_id"])
    prompt = encode_chat_prompt(tokenizer, MSGS)
    assert [smp["metadata"]["completion_id"] for smp in samples] == [f"{reply.id}:0",
                                                                     f"{reply.id}:1"]
    for smp, choice in zip(samples, reply.choices):
        out = smp["input_ids"][len(prompt):]
        assert smp["input_ids"][:len(prompt)] == prompt and 1 <= len(out) <= 5
        assert smp["loss_mask"] == [0] * len(prompt) + [1] * len(out)
        assert all(lp < 0 for lp in smp["logprobs"][len(prompt):])
        assert smp["versions"][len(prompt):] == [0] * len(out)
        text = tokenizer.decode(out, skip_special_tokens=True)
        assert choice.message.content == text


def test_greedy_is_deterministic_and_streams_match(real):
    s = start(real)
    c = client(real, s["api_key"])
    a = c.chat.completions.create(model="default", messages=MSGS, max_tokens=6, temperature=0)
    b = c.chat.completions.create(model="default", messages=MSGS, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    stream = c.chat.completions.create(model="default", messages=MSGS, max_tokens=6,
                                       temperature=0, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == a.choices[0].message.content


def test_async_client_streaming_with_usage(real):
    s = start(real)

    async def go():
        c = openai.AsyncOpenAI(base_url=real.base_url, api_key=s["api_key"], max_retries=0)
        stream = await c.chat.completions.create(
            model="default", messages=MSGS, max_tokens=4, stream=True,
            stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        await c.close()
        return chunks

    chunks = asyncio.run(go())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 4
    assert any(ch.choices and ch.choices[0].finish_reason for ch in chunks)


def test_completions_and_models(real):
    s = start(real)
    c = client(real, s["api_key"])
    assert [m.id for m in c.models.list()] == ["default"]
    r = c.completions.create(model="default", prompt="1+1=", max_tokens=3)
    assert len(r.choices) == 1
    stream = c.completions.create(model="default", prompt=[5, 6, 7], max_tokens=3, stream=True)
    assert any(ch.choices[0].finish_reason for ch in stream)
    samples = export(real, s["session_id"])
    assert len(samples) == 2 and samples[1]["input_ids"][:3] == [5, 6, 7]


def test_caps_are_enforced_with_clear_errors(real):
    c = client(real, start(real)["api_key"])
    with pytest.raises(openai.BadRequestError, match=r"max_tokens=64 is out of range; allowed "
                                                     r"\[1, 32\]"):
        c.chat.completions.create(model="default", messages=MSGS, max_tokens=64)
    with pytest.raises(openai.BadRequestError, match=r"n=5 is out of range; allowed \[1, 4\]"):
        c.chat.completions.create(model="default", messages=MSGS, max_tokens=2, n=5)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.chat.completions.create(model="default", messages=MSGS, temperature=3.0)
    # Unset max_tokens defaults to the cap.
    r = c.chat.completions.create(model="default", messages=MSGS, temperature=1.0)
    assert r.usage.completion_tokens <= 32


def test_multi_turn_prompt_reuses_sampled_tokens(real):
    s = start(real)
    c = client(real, s["api_key"])
    first = c.chat.completions.create(model="default", messages=MSGS, max_tokens=5)
    convo = MSGS + [first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "Again."}]
    second = c.chat.completions.create(model="default", messages=convo, max_tokens=5)
    stats = httpx.get(f"{real.url}/stats", headers=ADMIN).json()
    assert stats["reused_prompts"] >= 1
    samples = export(real, s["session_id"], style="concat")
    assert len(samples) == 1  # one conversation, one leaf
    smp = samples[0]
    assert smp["metadata"]["completion_ids"] == [first.id, second.id]
    assert sum(smp["loss_mask"]) == first.usage.completion_tokens + second.usage.completion_tokens


# ---- keys and isolation --------------------------------------------------------------------------

def test_missing_wrong_and_misused_keys_get_401(real):
    base = real.base_url
    for headers in ({}, {"Authorization": "Bearer nope"},
                    {"Authorization": "Bearer sk-asyncrl-0000-1111"}, ADMIN):
        r = httpx.post(f"{base}/chat/completions", headers=headers,
                       json={"model": "default", "messages": MSGS, "max_tokens": 2})
        assert r.status_code == 401, (headers, r.text)
        assert "key" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        client(real, "sk-asyncrl-bogus").chat.completions.create(model="default", messages=MSGS)
    s = start(real)
    session_key = {"Authorization": f"Bearer {s['api_key']}"}
    for path in ("/sessions", f"/sessions/{s['session_id']}/end",
                 f"/sessions/{s['session_id']}/export"):
        assert httpx.post(f"{real.url}{path}", headers=session_key, json={}).status_code == 401
    assert httpx.get(f"{real.url}/stats", headers=session_key).status_code == 401
    assert httpx.get(f"{base}/models").status_code == 401
    assert httpx.get(f"{real.url}/health").status_code == 200


def test_sessions_cannot_read_or_reward_each_other(real):
    a, b = start(real), start(real)
    ca, cb = client(real, a["api_key"]), client(real, b["api_key"])
    ra = ca.chat.completions.create(model="default", messages=MSGS, max_tokens=2)
    key_a = {"Authorization": f"Bearer {a['api_key']}"}
    key_b = {"Authorization": f"Bearer {b['api_key']}"}
    assert httpx.get(f"{real.base_url}/chat/completions/{ra.id}", headers=key_a).status_code == 200
    assert httpx.get(f"{real.base_url}/chat/completions/{ra.id}", headers=key_b).status_code == 404
    # B may not reward A's session, nor name A's completion in its own.
    r = httpx.post(f"{real.url}/sessions/{a['session_id']}/reward", headers=key_b,
                   json={"reward": 1.0})
    assert r.status_code == 401
    r = httpx.post(f"{real.url}/sessions/{b['session_id']}/reward", headers=key_b,
                   json={"reward": {ra.id: 1.0}})
    assert r.status_code == 404 and "not in this session" in r.json()["error"]["message"]
    cb.chat.completions.create(model="default", messages=MSGS, max_tokens=2)
    r = httpx.post(f"{real.url}/sessions/{a['session_id']}/reward", headers=key_a,
                   json={"reward": {ra.id: 0.75}})
    assert r.status_code == 200
    assert [smp["reward"] for smp in export(real, a["session_id"])] == [0.75]
    assert [smp["reward"] for smp in export(real, b["session_id"])] == [0.0]
    # Exported sessions are gone: their keys stop working.
    with pytest.raises(openai.AuthenticationError):
        ca.chat.completions.create(model="default", messages=MSGS, max_tokens=2)


# ---- limits --------------------------------------------------------------------------------------

def test_timeout_body_limit_and_capacity(tokenizer):
    engine = ScriptedEngine(tokenizer, lambda req: "ok")
    manager = StalenessManager(max_concurrent=8, batch_size=1, eta=0)
    version = [0]
    cfg = ProxyConfig(admin_key="admin-secret", session_timeout_s=0.5, max_body_bytes=2048,
                      max_sessions=2)
    with serving(engine, tokenizer, cfg,
                 admission=lambda: manager.capacity(version[0])) as (proxy, _):
        now = [0.0]  # the sessions' clock: idle time passes only when the test says so
        proxy.store.clock = lambda: now[0]
        s = start(proxy)
        manager.on_submit()  # the staleness budget at version 0 is now used up
        r = httpx.post(f"{proxy.url}/sessions", headers=ADMIN)
        assert r.status_code == 429 and "staleness" in r.json()["error"]["message"]
        assert r.headers["Retry-After"] == "1"
        version[0] = 1  # the trainer stepped: one more episode may start
        start(proxy)
        r = httpx.post(f"{proxy.url}/sessions", headers=ADMIN)
        assert r.status_code == 429 and "max_sessions=2" in r.json()["error"]["message"]
        c = client(proxy, s["api_key"])
        with pytest.raises(openai.APIStatusError) as err:
            c.chat.completions.create(model="default", max_tokens=2,
                                      messages=[{"role": "user", "content": "x" * 5000}])
        assert err.value.status_code == 413
        now[0] += 0.7  # past session_timeout_s
        with pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(model="default", messages=MSGS, max_tokens=2)
        assert proxy.store.expired >= 1
        start(proxy)  # expired sessions free their slots


# ---- tool calls ----------------------------------------------------------------------------------

def test_tool_calls_round_trip_with_the_openai_client(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, "6", "not a call <tool_call>{oops", "x"])
    with serving(engine, tokenizer) as (proxy, _):
        s = httpx.post(f"{proxy.url}/sessions", headers=ADMIN).json()
        c = client(proxy, s["api_key"])
        first = c.chat.completions.create(model="default", messages=MSGS, tools=TOOLS)
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and msg.content is None
        call = msg.tool_calls[0]
        assert call.function.name == "calc" and call.function.arguments == '{"expr":"2*3"}'
        convo = MSGS + [msg.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "6"}]
        second = c.chat.completions.create(model="default", messages=convo, tools=TOOLS)
        assert second.choices[0].message.content == "6"
        bad = c.chat.completions.create(model="default", messages=MSGS, tools=TOOLS)
        assert bad.choices[0].message.content == "not a call <tool_call>{oops"
        assert bad.choices[0].finish_reason == "stop" and not bad.choices[0].message.tool_calls
        r = httpx.post(f"{proxy.url}/sessions/{s['session_id']}/reward", headers=ADMIN,
                       json={"reward": {second.id: 1.0}})
        assert r.status_code == 200
        samples = httpx.post(f"{proxy.url}/sessions/{s['session_id']}/export", headers=ADMIN,
                             json={"style": "concat", "turn_discount": 0.5}).json()["samples"]
    # Leaves: the two-turn tool conversation, and the malformed single turn.
    convo_sample, bad_sample = samples
    ids = convo_sample["input_ids"]
    call_ids = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    start_ = len(encode_chat_prompt(tokenizer, MSGS, tools=TOOLS))
    assert ids[start_:start_ + len(call_ids)] == call_ids  # the sampled call, not a re-rendering
    assert convo_sample["reward"] == pytest.approx(0.5)  # 0 + 0.5 * 1.0
    assert bad_sample["reward"] == 0.0
    tail = tokenizer.decode(ids[start_ + len(call_ids):])
    assert tail == "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n6<|im_end|>"
    mask = convo_sample["loss_mask"]
    assert sum(mask) == len(call_ids) + 2 and mask[-2:] == [1, 1]


def test_streamed_tool_calls_with_the_async_client(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL])
    with serving(engine, tokenizer) as (proxy, _):
        s = httpx.post(f"{proxy.url}/sessions", headers=ADMIN).json()

        async def go():
            c = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s["api_key"], max_retries=0)
            stream = await c.chat.completions.create(model="default", messages=MSGS,
                                                     tools=TOOLS, stream=True)
            calls, finish = [], None
            async for ch in stream:
                delta = ch.choices[0].delta
                calls += delta.tool_calls or []
                finish = ch.choices[0].finish_reason or finish
            await c.close()
            return calls, finish

        calls, finish = asyncio.run(go())
    assert finish == "tool_calls" and calls[0].function.name == "calc"


def test_stop_strings_cut_text_but_recording_keeps_every_token(tokenizer):
    engine = ScriptedEngine(tokenizer, ["abc STOP def"])
    with serving(engine, tokenizer) as (proxy, _):
        s = httpx.post(f"{proxy.url}/sessions", headers=ADMIN).json()
        r = client(proxy, s["api_key"]).chat.completions.create(
            model="default", messages=MSGS, stop=["STOP"], max_tokens=20, temperature=0.5,
            top_p=0.9)
        assert r.choices[0].message.content == "abc "
        g = engine.requests[0].gconfig
        assert (g.stop, g.max_new_tokens, g.temperature, g.top_p) == (["STOP"], 20, 0.5, 0.9)
        assert tokenizer.eos_token_id in g.stop_token_ids
        smp = httpx.post(f"{proxy.url}/sessions/{s['session_id']}/export", headers=ADMIN,
                         json={}).json()["samples"][0]
    assert tokenizer.decode(smp["input_ids"][-13:]) == "abc STOP def<|im_end|>"


def test_server_keeps_idle_connections_longer_than_clients_do(real):
    # uvicorn's default (5 s) equals httpx's pool expiry: a client reusing a connection the
    # server was closing at that instant got APIConnectionError (seen in a 40-step agent run).
    assert real._server.config.timeout_keep_alive == ProxyConfig().keep_alive_s >= 60
