"""Anthropic's Messages API on the proxy and on `asyncrl serve`, driven by the official
`anthropic` SDK (optional extra `agents`) over real HTTP: tool use over several turns with the
sampled ids reused, streaming events, stop sequences, rewards by message id, both auth headers,
and errors in Anthropic's shape.

Tool-use replies come from a scripted engine (an untrained tiny model never writes a well-formed
call); recording and sampling run on the real built-in engine.
"""

import json
import os

import httpx
import pytest

try:
    import anthropic
except ImportError as err:
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        raise ImportError("CI is set but the anthropic SDK is missing; .ci/run installs it "
                          "with pip install -e '.[test,agents]'") from err
    pytest.skip("the anthropic SDK is an optional extra: pip install -e '.[agents]'",
                allow_module_level=True)

from asyncrl.models.chat import encode_chat_prompt  # noqa: E402
from asyncrl.models.loading import load_tokenizer  # noqa: E402
from tests.proxy_helpers import ScriptedEngine, real_engine_proxy, serving  # noqa: E402

ADMIN = {"Authorization": "Bearer admin-secret"}
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>'
TOOLS = [{"name": "calc", "description": "Evaluate arithmetic",
          "input_schema": {"type": "object", "properties": {"expr": {"type": "string"}}}}]
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate arithmetic",
    "parameters": TOOLS[0]["input_schema"]}}]
SYSTEM = "You compute."
USER = [{"role": "user", "content": "2+3="}]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def session(proxy) -> dict:
    return httpx.post(f"{proxy.url}/sessions", headers=ADMIN).json()


def client(proxy, key: str, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0, **kw)


def test_tool_use_over_turns_reuses_the_sampled_ids_and_rewards_by_message_id(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, "6", "done"])
    with serving(engine, tokenizer) as (proxy, _):
        s = session(proxy)
        c = client(proxy, s["api_key"])
        first = c.messages.create(model="default", max_tokens=400, system=SYSTEM,
                                  messages=USER, tools=TOOLS, metadata={"user_id": "u1"})
        assert first.id.startswith("msg_") and first.stop_reason == "tool_use"
        (use,) = first.content
        assert use.type == "tool_use" and use.name == "calc" and use.input == {"expr": "2*3"}
        convo = USER + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                        {"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": use.id, "content": "6"}]}]
        second = c.messages.create(model="default", max_tokens=400, system=SYSTEM,
                                   messages=convo, tools=TOOLS)
        assert [b.type for b in second.content] == ["text"] and second.content[0].text == "6"
        assert second.stop_reason == "end_turn" and second.usage.output_tokens == 2
        # a third turn whose text goes on after the tool result, blocks as a list
        third = c.messages.create(model="default", max_tokens=400, system=SYSTEM, tools=TOOLS,
                                  messages=convo + [
                                      {"role": "assistant", "content": "6"},
                                      {"role": "user", "content": [{"type": "text",
                                                                    "text": "thanks"}]}])
        assert third.content[0].text == "done"
        r = httpx.post(f"{proxy.url}/sessions/{s['session_id']}/reward", headers=ADMIN,
                       json={"reward": {third.id: 1.0}})
        assert r.status_code == 200, r.text
        stats = httpx.get(f"{proxy.url}/stats", headers=ADMIN).json()
        samples = httpx.post(f"{proxy.url}/sessions/{s['session_id']}/export", headers=ADMIN,
                             json={"style": "concat"}).json()["samples"]
    assert stats["reused_prompts"] == 2  # each turn continued the sampled ids
    (sample,) = samples  # one conversation: each turn continued the one before
    assert sample["reward"] == 1.0
    ids = sample["input_ids"]
    head = encode_chat_prompt(tokenizer, [{"role": "system", "content": SYSTEM}, *USER],
                              tools=OPENAI_TOOLS)
    call_ids = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert ids[:len(head)] == head and ids[len(head):len(head) + len(call_ids)] == call_ids
    assert tokenizer.decode(ids[len(head) + len(call_ids):]) == (
        "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n6<|im_end|>\n"
        "<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\ndone<|im_end|>")


def test_streaming_gives_anthropics_event_sequence(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a fairly long reply that takes several deltas",
                                        CALL])
    with serving(engine, tokenizer) as (proxy, _):
        s = session(proxy)
        c = client(proxy, s["api_key"])
        with c.messages.stream(model="default", max_tokens=400, messages=USER) as stream:
            pieces = list(stream.text_stream)
            final = stream.get_final_message()
        assert len(pieces) > 1 and "".join(pieces) == final.content[0].text
        assert final.content[0].text == "a fairly long reply that takes several deltas"
        assert final.stop_reason == "end_turn"
        with httpx.stream("POST", f"{proxy.url}/v1/messages",
                          headers={"x-api-key": s["api_key"]},
                          json={"model": "default", "max_tokens": 64, "messages": USER,
                                "tools": TOOLS, "stream": True}) as r:
            events = [line.removeprefix("event: ") for line in r.iter_lines()
                      if line.startswith("event: ")]
        assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
        assert events[1] == "content_block_start" and "content_block_delta" in events
        assert events.count("content_block_stop") == 1


def test_streamed_tool_use_with_the_sdk(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL])
    with serving(engine, tokenizer) as (proxy, _):
        c = client(proxy, session(proxy)["api_key"])
        with c.messages.stream(model="default", max_tokens=400, messages=USER,
                               tools=TOOLS) as stream:
            final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use" and final.content[0].input == {"expr": "2*3"}


def test_stop_sequences_auth_headers_and_errors_in_anthropics_shape(tokenizer):
    engine = ScriptedEngine(tokenizer, ["abc STOP def", "x"])
    with serving(engine, tokenizer) as (proxy, _):
        s = session(proxy)
        # Authorization: Bearer (the SDK's auth_token) works as well as x-api-key
        c = anthropic.Anthropic(base_url=proxy.url, auth_token=s["api_key"], max_retries=0)
        r = c.messages.create(model="default", max_tokens=20, messages=USER,
                              stop_sequences=["STOP"], inference_geo="eu", speed="standard",
                              extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7})
        assert r.content[0].text == "abc " and r.stop_reason == "stop_sequence"
        assert r.stop_sequence == "STOP"
        g = engine.requests[0].gconfig
        assert (g.stop, g.max_new_tokens, g.temperature, g.top_p, g.top_k) == (
            ["STOP"], 20, 0.5, 0.9, 7)
        with pytest.raises(anthropic.AuthenticationError) as err:
            client(proxy, "sk-wrong").messages.create(model="default", max_tokens=8,
                                                      messages=USER)
        assert err.value.body["error"]["type"] == "authentication_error"
        c = client(proxy, s["api_key"])
        with pytest.raises(anthropic.BadRequestError) as err:
            c.messages.create(model="default", max_tokens=8, messages=USER, tools=TOOLS,
                              tool_choice={"type": "any"})
        assert err.value.body == {"type": "error", "error": {
            "type": "invalid_request_error", "message": err.value.body["error"]["message"]}}
        assert "tool_choice.type" in err.value.body["error"]["message"]
        for body, field in [({"max_tokens": 8, "messages": USER}, "model"),
                            ({"model": "m", "messages": USER}, "max_tokens"),
                            ({"model": "m", "max_tokens": 8, "messages": [],
                              }, "messages"),
                            ({"model": "m", "max_tokens": 8, "messages": USER,
                              "container": "c1"}, "container"),
                            ({"model": "m", "max_tokens": 8, "messages": USER,
                              "output_config": {"format": {"type": "json_schema"}}},
                             "output_config.format")]:
            r = httpx.post(f"{proxy.url}/v1/messages", json=body,
                           headers={"x-api-key": s["api_key"]})
            assert r.status_code == 400 and r.json()["type"] == "error", r.text
            assert field in r.json()["error"]["message"]
        r = httpx.post(f"{proxy.url}/v1/messages", content=b"{not json",
                       headers={"x-api-key": s["api_key"], "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_recorded_exactly_on_the_real_engine(model_dir, tokenizer, one_thread):
    with real_engine_proxy(model_dir, tokenizer) as (proxy, s):
        msg = client(proxy, s["api_key"]).messages.create(
            model="default", max_tokens=12, messages=USER)
        stored = httpx.get(f"{proxy.base_url}/chat/completions/{msg.id}",
                           headers={"Authorization": f"Bearer {s['api_key']}"}).json()
    assert stored["id"] == msg.id and len(stored["output_ids"]) == msg.usage.output_tokens
    assert stored["prompt_ids"] == encode_chat_prompt(tokenizer, USER)
    assert len(stored["logprobs"]) == len(stored["versions"]) == len(stored["output_ids"])
    assert msg.stop_reason in ("end_turn", "max_tokens")


def test_asyncrl_serve_answers_messages(model_dir, one_thread):
    """The same route on the inference server (a real `asyncrl serve` process), both headers."""
    from conftest import running_servers

    with running_servers(model_dir, 1, "--api-key", "k1") as [(url, _)]:
        c = anthropic.Anthropic(base_url=url, api_key="k1", max_retries=0)
        msg = c.messages.create(model="default", max_tokens=6, messages=USER, system=SYSTEM)
        assert msg.type == "message" and msg.usage.output_tokens >= 1
        with c.messages.stream(model="default", max_tokens=6, messages=USER) as stream:
            assert stream.get_final_message().usage.output_tokens >= 1
        r = httpx.post(f"{url}/v1/messages", headers={"Authorization": "Bearer k1"},
                       json={"model": "m", "max_tokens": 4, "messages": USER,
                             "tool_choice": {"type": "tool", "name": "x"}})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.post(f"{url}/v1/messages", json={"model": "m", "max_tokens": 4,
                                                    "messages": USER})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert json.loads(r.text)["type"] == "error"
