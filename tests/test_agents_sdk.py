"""The OpenAI Agents SDK (optional extra `agents`) against our servers, with its default model
class (the Responses API).

Pins the exact request fields the SDK's Responses model sends (captured with an in-process mock
transport and checked against our strict request schema), then runs the example agent
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
    from agents.exceptions import ModelBehaviorError
    from openai.types.shared import Reasoning
except ImportError as err:
    # CI installs the extra (.ci/run): there a missing SDK is a broken install, not a skip.
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        raise ImportError("CI is set but the OpenAI Agents SDK is missing; .ci/run installs it "
                          "with pip install -e '.[test,agents]'") from err
    pytest.skip("the OpenAI Agents SDK is an optional extra: pip install -e '.[agents]'",
                allow_module_level=True)
import openai  # noqa: E402  (a dependency of openai-agents)

from asyncrl.inference import responses_api  # noqa: E402
from asyncrl.models.chat import encode_chat_prompt  # noqa: E402
from asyncrl.models.loading import load_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.agents_sdk.agent import AgentsSDKMathAgent, run_config  # noqa: E402

from asyncrl.rollout.calculator import calc  # noqa: E402

DATA = {"messages": [{"role": "user", "content": "12+34="}], "answer": 46}
NO_TRACING = RunConfig(tracing_disabled=True)

# What openai-agents 0.24's Responses model sends for ModelSettings(max_tokens=8,
# temperature=1.0). A new field here means the server schema needs a look: it rejects unknown
# fields.
BASE_FIELDS = {"model", "input", "include", "max_output_tokens", "temperature", "tools"}
SDK_FIELDS = {
    (False, False): BASE_FIELDS,
    (False, True): BASE_FIELDS | {"stream"},
    (True, False): BASE_FIELDS,
    (True, True): BASE_FIELDS | {"stream"},
}


class MockOpenAI:
    """An httpx transport standing in for the server's /v1/responses: records bodies, replies
    `answer` (or, once, a `calc` function call when tools are offered and `call_tool` is set),
    in the shapes responses_api writes."""

    def __init__(self, answer="46", call_tool=False):
        self.answer, self.call_tool, self.bodies = answer, call_tool, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        message = {"role": "assistant", "content": self.answer}
        finish = "stop"
        answered = any(i.get("type") == "function_call_output" for i in body["input"])
        if self.call_tool and body.get("tools") and not answered:
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "calc", "arguments": json.dumps({"expr": "12+34"})}}]}
            finish = "tool_calls"
        reply = {"model": "default", "choices": [{"message": message, "finish_reason": finish}],
                 "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
        response = responses_api.from_chat(reply, "resp_1",
                                           responses_api.ResponsesBody.model_validate(body))
        if not body.get("stream"):
            return httpx.Response(200, json=response)
        text = "".join(responses_api.stream_events(response))
        return httpx.Response(200, content=text.encode(),
                              headers={"content-type": "text/event-stream"})


def mock_kwargs(mock):
    return {"base_url": "http://mock.invalid/v1", "api_key": "k",
            "http_client": httpx.AsyncClient(transport=httpx.MockTransport(mock))}


async def run_agent(example, stream, **kwargs):
    """Run the example's SDK agent (streamed or not) and return its final output."""
    client = openai.AsyncOpenAI(max_retries=0, **kwargs)
    agent, cfg = example.build_agent(), run_config(client)
    if not stream:
        return (await Runner.run(agent, DATA["messages"], run_config=cfg)).final_output
    result = Runner.run_streamed(agent, DATA["messages"], run_config=cfg)
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
        assert body["max_output_tokens"] == 8 and body["temperature"] == 1.0
        chat = responses_api.to_chat(responses_api.ResponsesBody.model_validate(body), [])
        assert encode_chat_prompt(tokenizer, chat.message_dicts(), tools=chat.tool_dicts())
    if tools:
        assert chat.tool_dicts()[0]["function"]["name"] == "calc"
        # the second turn replays the call and its result, which the chat template renders
        messages = chat.message_dicts()
        assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
        assert messages[1]["tool_calls"][0]["function"]["name"] == "calc"
        assert messages[2]["content"] == "46"


@pytest.mark.parametrize("reply, reward", [("46", 1.0), (" 46\n", 1.0), ("45", 0.0),
                                           ("46.", 0.0)])
def test_reward_is_exact_match_of_the_final_output(reply, reward):
    agent = pickle.loads(pickle.dumps(AgentsSDKMathAgent()))
    assert asyncio.run(agent.run(DATA, **mock_kwargs(MockOpenAI(reply)))) == reward


def test_calculator_tool_parses_instead_of_eval():
    """The agents' tool (asyncrl/rollout/calculator.py): a value, or an error the model reads."""
    assert calc("12+34*2") == "80" and calc(" -3 - 4 ") == "-7"
    for bad in ("__import__('os')", "2**10", "1/2", "", "1.5+1"):
        assert calc(bad).startswith("error: "), bad


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
    # the untrained model will not call calc; the point is that requests and replies parse. A
    # reply cut at max_tokens is a response with status "incomplete", which the SDK raises on.
    try:
        output = asyncio.run(run_agent(example, stream, base_url=server, api_key="k"))
    except ModelBehaviorError as err:
        assert "incomplete" in str(err) and "max_output_tokens" in str(err)
    else:
        assert isinstance(output, str) and len(output) <= 8


@pytest.mark.parametrize("settings, field", [
    (ModelSettings(max_tokens=8, tool_choice="required"), "tool_choice"),
    (ModelSettings(max_tokens=8, reasoning=Reasoning(effort="high")), "reasoning.effort"),
    (ModelSettings(max_tokens=8, top_logprobs=2), "top_logprobs"),
])
def test_settings_the_server_cannot_honour_fail_with_a_clear_400(server, settings, field):
    async def main():
        client = openai.AsyncOpenAI(base_url=server, api_key="k", max_retries=0)
        agent = AgentsSDKMathAgent(use_calculator=True).build_agent()
        agent.model_settings = settings
        await Runner.run(agent, DATA["messages"], run_config=run_config(client))

    with pytest.raises(openai.BadRequestError, match=field) as err:
        asyncio.run(main())
    assert err.value.status_code == 400
