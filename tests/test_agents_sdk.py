"""The OpenAI Agents SDK (optional extra `agents`) against our OpenAI-compatible server.

Pins the exact request fields the SDK's Chat Completions model sends (captured with an in-process
mock transport and checked against our strict request schema), then runs the example agent
(examples/agents_sdk/agent.py) unchanged against a real `asyncrl serve` process.
"""

import asyncio
import json
import os
import pickle
import sys
from pathlib import Path

import httpx
import pytest
from conftest import running_servers

try:
    from agents import ModelSettings, RunConfig, Runner
except ImportError as err:
    # CI installs the extra (.ci/run): there a missing SDK is a broken install, not a skip.
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        raise ImportError("CI is set but the OpenAI Agents SDK is missing; .ci/run installs it "
                          "with pip install -e '.[test,agents]'") from err
    pytest.skip("the OpenAI Agents SDK is an optional extra: pip install -e '.[agents]'",
                allow_module_level=True)
import openai  # noqa: E402  (a dependency of openai-agents)

from asyncrl.inference.http_schema import ChatCompletionBody  # noqa: E402
from asyncrl.models.chat import encode_chat_prompt  # noqa: E402
from asyncrl.models.loading import load_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.agents_sdk.agent import AgentsSDKMathAgent, evaluate  # noqa: E402

DATA = {"messages": [{"role": "user", "content": "12+34="}], "answer": 46}
NO_TRACING = RunConfig(tracing_disabled=True)

# What openai-agents 0.24 sends for ModelSettings(max_tokens=8, temperature=1.0) to a non-OpenAI
# base_url (it adds store / stream_options only for api.openai.com). A new field here means the
# server schema needs a look: it rejects unknown fields.
BASE_FIELDS = {"model", "messages", "max_tokens", "temperature"}
SDK_FIELDS = {
    (False, False): BASE_FIELDS,
    (False, True): BASE_FIELDS | {"stream"},
    (True, False): BASE_FIELDS | {"tools"},
    (True, True): BASE_FIELDS | {"tools", "stream"},
}


class MockOpenAI:
    """An httpx transport standing in for the server: records bodies, replies `answer` (or, once,
    a `calc` tool call when tools are offered and `call_tool` is set)."""

    def __init__(self, answer="46", call_tool=False):
        self.answer, self.call_tool, self.bodies = answer, call_tool, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        head = {"id": "chatcmpl-1", "created": 0, "model": "default"}
        message = {"role": "assistant", "content": self.answer}
        finish = "stop"
        if self.call_tool and body.get("tools") and body["messages"][-1]["role"] != "tool":
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "calc", "arguments": json.dumps({"expr": "12+34"})}}]}
            finish = "tool_calls"
        if not body.get("stream"):
            return httpx.Response(200, json={**head, "object": "chat.completion", "choices": [
                {"index": 0, "message": message, "finish_reason": finish}]})
        chunk = {**head, "object": "chat.completion.chunk"}
        delta = {"role": "assistant", "content": self.answer}
        if message["content"] is None:
            delta = {"role": "assistant", "tool_calls": [{"index": 0, **message["tool_calls"][0]}]}
        events = [{**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                  {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}]
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(),
                              headers={"content-type": "text/event-stream"})


def mock_kwargs(mock):
    return {"base_url": "http://mock.invalid/v1", "api_key": "k",
            "http_client": httpx.AsyncClient(transport=httpx.MockTransport(mock))}


async def run_agent(example, stream, **kwargs):
    """Run the example's SDK agent (streamed or not) and return its final output."""
    client = openai.AsyncOpenAI(max_retries=0, **kwargs)
    agent = example.build_agent(client)
    if not stream:
        return (await Runner.run(agent, DATA["messages"], run_config=NO_TRACING)).final_output
    result = Runner.run_streamed(agent, DATA["messages"], run_config=NO_TRACING)
    async for _ in result.stream_events():
        pass
    return result.final_output


@pytest.mark.parametrize("tools, stream", sorted(SDK_FIELDS))
def test_sdk_request_fields_pass_the_server_schema(model_dir, tools, stream):
    mock = MockOpenAI(call_tool=True)
    example = AgentsSDKMathAgent(use_calculator=tools)
    assert asyncio.run(run_agent(example, stream, **mock_kwargs(mock))) == "46"
    assert len(mock.bodies) == (2 if tools else 1)  # with tools: call calc, then answer
    tokenizer = load_tokenizer(model_dir)
    for body in mock.bodies:
        assert set(body) == SDK_FIELDS[tools, stream], body
        assert body["max_tokens"] == 8 and body["temperature"] == 1.0
        parsed = ChatCompletionBody.model_validate(body)
        assert encode_chat_prompt(tokenizer, parsed.message_dicts(), tools=parsed.tool_dicts())
    if tools:
        assert body["tools"][0]["function"]["name"] == "calc"
        # the second turn replays the call and its result, which the chat template renders
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool"]
        assert body["messages"][1]["tool_calls"][0]["function"]["name"] == "calc"
        assert body["messages"][2]["content"] == "46"


@pytest.mark.parametrize("reply, reward", [("46", 1.0), (" 46\n", 1.0), ("45", 0.0),
                                           ("46.", 0.0)])
def test_reward_is_exact_match_of_the_final_output(reply, reward):
    agent = pickle.loads(pickle.dumps(AgentsSDKMathAgent()))
    assert asyncio.run(agent.run(DATA, **mock_kwargs(MockOpenAI(reply)))) == reward


def test_calculator_tool_parses_instead_of_eval():
    assert evaluate("12+34*2") == 80 and evaluate(" -3 - 4 ") == -7
    for bad in ("__import__('os')", "2**10", "1/2", "", "1.5+1"):
        with pytest.raises(ValueError, match="expr="):
            evaluate(bad)


@pytest.fixture(scope="module")
def server(model_dir):
    with running_servers(model_dir, 1, "engine.max_seq_len=256") as [(url, _)]:
        yield url + "/v1"


def test_example_agent_runs_unchanged_against_asyncrl_serve(server):
    async def main():
        async with httpx.AsyncClient(timeout=60) as shared:  # the inline runner's shared client
            agent = pickle.loads(pickle.dumps(AgentsSDKMathAgent()))
            rewards = await asyncio.gather(*(agent.run(DATA, base_url=server, api_key="k",
                                                       http_client=shared) for _ in range(3)))
            assert not shared.is_closed  # an injected client is the caller's to close
        alone = await AgentsSDKMathAgent().run(DATA, base_url=server, api_key="k")
        return [*rewards, alone]

    rewards = asyncio.run(main())
    assert all(type(r) is float and r in (0.0, 1.0) for r in rewards), rewards


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_agent_against_asyncrl_serve(server, stream):
    example = AgentsSDKMathAgent(instructions="Use calc for arithmetic.", use_calculator=True)
    output = asyncio.run(run_agent(example, stream, base_url=server, api_key="k"))
    # the untrained model will not call calc; the point is that requests and replies parse
    assert isinstance(output, str) and len(output) <= 8


def test_streamed_usage_reaches_the_sdk(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server, api_key="k", max_retries=0)
        agent = AgentsSDKMathAgent().build_agent(client)
        agent.model_settings = ModelSettings(max_tokens=8, temperature=1.0, include_usage=True)
        result = Runner.run_streamed(agent, DATA["messages"], run_config=NO_TRACING)
        async for _ in result.stream_events():
            pass
        return result.context_wrapper.usage

    usage = asyncio.run(main())
    assert usage.input_tokens > 0 and 1 <= usage.output_tokens <= 8


@pytest.mark.parametrize("settings, field", [
    (ModelSettings(max_tokens=8, tool_choice="required"), "tool_choice"),
    (ModelSettings(max_tokens=8, frequency_penalty=0.5), "frequency_penalty"),
    (ModelSettings(max_tokens=8, top_logprobs=2), "top_logprobs"),
])
def test_settings_the_server_cannot_honour_fail_with_a_clear_400(server, settings, field):
    async def main():
        client = openai.AsyncOpenAI(base_url=server, api_key="k", max_retries=0)
        agent = AgentsSDKMathAgent(use_calculator=True).build_agent(client)
        agent.model_settings = settings
        await Runner.run(agent, DATA["messages"], run_config=NO_TRACING)

    with pytest.raises(openai.BadRequestError, match=field) as err:
        asyncio.run(main())
    assert err.value.status_code == 400
