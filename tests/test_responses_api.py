"""OpenAI's Responses API on the proxy and on `asyncrl serve`, with the real `openai` client and
the OpenAI Agents SDK's default model class (optional extra `agents`): function calls over
several turns with the sampled ids reused, previous_response_id, streaming events, rewards by
response id, and refused fields named.

Function-call replies come from a scripted engine (an untrained tiny model never writes a
well-formed call); recording runs on the real built-in engine.
"""

import asyncio
import os

import httpx
import openai
import pytest

from asyncrl.models.chat import encode_chat_prompt
from asyncrl.models.loading import load_tokenizer
from tests.proxy_helpers import ScriptedEngine, real_engine_proxy, serving

ADMIN = {"Authorization": "Bearer admin-secret"}
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>'
TOOLS = [{"type": "function", "name": "calc", "description": "Evaluate arithmetic",
          "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items()
                                                 if k != "type"}}]
INSTRUCTIONS = "You compute."


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def session(proxy) -> dict:
    return httpx.post(f"{proxy.url}/sessions", headers=ADMIN).json()


def client(proxy, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)


def _turns(c, previous: bool):
    first = c.responses.create(model="default", instructions=INSTRUCTIONS, input="2+3=",
                               tools=TOOLS, max_output_tokens=400)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "calc"
    assert call.arguments == '{"expr":"2*3"}' and first.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "6"}
    if previous:
        second = c.responses.create(model="default", instructions=INSTRUCTIONS, tools=TOOLS,
                                    input=[result], previous_response_id=first.id,
                                    max_output_tokens=400)
    else:
        items = [{"role": "user", "content": "2+3="}, *[o.model_dump() for o in first.output],
                 result]
        second = c.responses.create(model="default", instructions=INSTRUCTIONS, tools=TOOLS,
                                    input=items, max_output_tokens=400)
    assert second.output_text == "6" and second.output[0].type == "message"
    return first, second


@pytest.mark.parametrize("previous", [False, True], ids=["whole_input", "previous_response_id"])
def test_function_calls_over_turns_reuse_the_sampled_ids(tokenizer, previous):
    engine = ScriptedEngine(tokenizer, [CALL, "6"])
    with serving(engine, tokenizer) as (proxy, _):
        s = session(proxy)
        first, second = _turns(client(proxy, s["api_key"]), previous)
        assert first.id.startswith("resp_") and second.usage.output_tokens == 2
        r = httpx.post(f"{proxy.url}/sessions/{s['session_id']}/reward", headers=ADMIN,
                       json={"reward": {second.id: 1.0}})
        assert r.status_code == 200, r.text
        stats = httpx.get(f"{proxy.url}/stats", headers=ADMIN).json()
        (sample,) = httpx.post(f"{proxy.url}/sessions/{s['session_id']}/export",
                               headers=ADMIN, json={"style": "concat"}).json()["samples"]
    assert stats["reused_prompts"] == 1 and sample["reward"] == 1.0
    head = encode_chat_prompt(tokenizer, [{"role": "system", "content": INSTRUCTIONS},
                                          {"role": "user", "content": "2+3="}],
                              tools=CHAT_TOOLS)
    call_ids = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    ids = sample["input_ids"]
    assert ids[:len(head)] == head and ids[len(head):len(head) + len(call_ids)] == call_ids
    assert tokenizer.decode(ids[len(head) + len(call_ids):]) == (
        "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n6<|im_end|>")


def test_streaming_events_and_refused_fields(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a reply long enough for several deltas", CALL])
    with serving(engine, tokenizer) as (proxy, _):
        s = session(proxy)
        c = client(proxy, s["api_key"])
        kinds, deltas, final = [], [], None
        for event in c.responses.create(model="default", input="hi", stream=True,
                                        max_output_tokens=400):
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type == "response.completed":
                final = event.response
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed" and len(deltas) > 1
        assert "".join(deltas) == final.output_text == "a reply long enough for several deltas"
        with c.responses.stream(model="default", input="hi", tools=TOOLS,
                                max_output_tokens=400) as stream:
            done = stream.get_final_response()
        assert done.output[0].type == "function_call" and done.output[0].name == "calc"
        for kwargs, field in [({"tool_choice": "required"}, "tool_choice"),
                              ({"tools": [{"type": "web_search"}]}, "tools[0]"),
                              ({"text": {"format": {"type": "json_object"}}},
                               "text.format.type"),
                              ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
                              ({"background": True}, "background"),
                              ({"input": [{"type": "computer_call"}]}, "input[0].type")]:
            with pytest.raises(openai.BadRequestError) as err:
                c.responses.create(**{"model": "default", "input": "hi", **kwargs})
            assert field in err.value.message, (field, err.value.message)
        with pytest.raises(openai.NotFoundError, match="previous_response_id"):
            c.responses.create(model="default", input="hi", previous_response_id="resp_nope")


def test_recorded_exactly_on_the_real_engine(model_dir, tokenizer, one_thread):
    with real_engine_proxy(model_dir, tokenizer) as (proxy, s):
        resp = client(proxy, s["api_key"]).responses.create(
            model="default", input=[{"role": "user", "content": [
                {"type": "input_text", "text": "2+3="}]}], max_output_tokens=12)
        stored = httpx.get(f"{proxy.base_url}/chat/completions/{resp.id}",
                           headers={"Authorization": f"Bearer {s['api_key']}"}).json()
    assert stored["prompt_ids"] == encode_chat_prompt(tokenizer, [{"role": "user",
                                                                   "content": "2+3="}])
    assert len(stored["output_ids"]) == resp.usage.output_tokens == len(stored["logprobs"])


def test_the_agents_sdk_default_model_runs_unchanged(tokenizer):
    """`Agent(..., model="default")` with the SDK's default provider (the Responses model),
    a function tool called and its output read back, through the proxy."""
    try:
        from agents import Agent, RunConfig, Runner, function_tool
        from agents.models.openai_provider import OpenAIProvider
    except ImportError:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            raise
        pytest.skip("the OpenAI Agents SDK is an optional extra: pip install -e '.[agents]'")

    @function_tool
    def calc(expr: str) -> str:
        """Evaluate arithmetic."""
        return "6" if expr == "2*3" else "?"

    engine = ScriptedEngine(tokenizer, [CALL, "The answer is 6."])
    with serving(engine, tokenizer) as (proxy, _):
        s = session(proxy)

        async def run():
            c = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s["api_key"],
                                   max_retries=0)
            agent = Agent(name="math", instructions=INSTRUCTIONS, tools=[calc],
                          model="default")
            cfg = RunConfig(model_provider=OpenAIProvider(openai_client=c),
                            tracing_disabled=True)
            return await Runner.run(agent, "2+3=", run_config=cfg)

        result = asyncio.run(run())
        stats = httpx.get(f"{proxy.url}/stats", headers=ADMIN).json()
    assert result.final_output == "The answer is 6."
    usage = result.context_wrapper.usage  # what the two responses reported
    assert usage.requests == 2 and usage.output_tokens > 0 and usage.input_tokens > 0
    assert stats["completions"] == 2 and stats["reused_prompts"] == 1
    tool_turn = engine.requests[1].input_ids
    assert tokenizer.decode(tool_turn).endswith(
        "<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n")


def test_asyncrl_serve_answers_responses(model_dir, one_thread):
    """The same route on the inference server (a real `asyncrl serve` process)."""
    from conftest import running_servers

    with running_servers(model_dir, 1, "--api-key", "k1") as [(url, _)]:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0)
        first = c.responses.create(model="default", input="hi", max_output_tokens=6,
                                   instructions=INSTRUCTIONS)
        assert first.usage.output_tokens >= 1 and first.output[0].type == "message"
        second = c.responses.create(model="default", input="more", max_output_tokens=6,
                                    previous_response_id=first.id)
        assert second.previous_response_id == first.id
        events = [e.type for e in c.responses.create(model="default", input="hi",
                                                     max_output_tokens=4, stream=True)]
        assert events[0] == "response.created" and events[-1] in ("response.completed",
                                                                   "response.incomplete")
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model="default", input="x", previous_response_id="resp_gone")
