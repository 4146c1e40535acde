"""Reply parsers and chat options, without servers: tool-call formats by name (hermes,
llama3_json, mistral, pythonic), `<think>` reasoning splitters (deepseek_r1, qwen3), the options'
config checks, and chat template variables reaching every prompt the workflows and SFT render."""

import asyncio
import json

import pytest

from asyncrl.api import GenerationConfig
from asyncrl.config import ConfigError
from asyncrl.launch.train_config import TrainRunConfig
from asyncrl.models.chat import encode_chat_prompt, render_chat
from asyncrl.models.chat_options import ChatOptions
from asyncrl.models.reasoning import reasoning_parser
from asyncrl.models.tokenizer import CHAT_TEMPLATE, build_byte_tokenizer
from asyncrl.models.tool_parsers import TOOL_PARSERS, tool_parser
from asyncrl.rollout.answer_eval import EvalConfig, evaluate
from asyncrl.rollout.arithmetic_env import ArithmeticEnv, ChatAgent
from asyncrl.rollout.agent_env import AgentEnvConfig, AgentEnvWorkflow
from asyncrl.rollout.multi_turn import MultiTurnConfig, MultiTurnWorkflow
from asyncrl.rollout.rlvr import RLVRWorkflow
from asyncrl.train.sft import build_examples
from tests.proxy_helpers import ScriptedEngine

# The tiny model's ChatML template with Qwen3.5's generation prompt: the template opens the
# think block (the reply then holds only `</think>`), or closes an empty one when
# enable_thinking is false.
GEN_PROMPT = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
THINKING_PROMPT = (
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}")
assert CHAT_TEMPLATE.endswith(GEN_PROMPT)
THINKING_TEMPLATE = CHAT_TEMPLATE[:-len(GEN_PROMPT)] + THINKING_PROMPT
OFF = {"enable_thinking": False}
ROW = {"id": 1, "messages": [{"role": "user", "content": "2+3="}], "answer": "5"}


@pytest.fixture(scope="module")
def tok():
    t = build_byte_tokenizer()
    t.chat_template = THINKING_TEMPLATE
    return t


def fn(call: dict) -> tuple[str, dict]:
    return call["function"]["name"], json.loads(call["function"]["arguments"])


# ---- tool parsers -------------------------------------------------------------------------------

WELL_FORMED = {
    "hermes": ('<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>', None),
    "llama3_json": ('<|python_tag|>{"name": "calc", "parameters": {"expr": "2*3"}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "calc", "arguments": {"expr": "2*3"}}]', None),
    "pythonic": ('[calc(expr="2*3")]', None),
}
SEVERAL = {
    "hermes": 'Two.<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>\n'
              '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": [2]}"}</tool_call>',
    "llama3_json": 'Two. {"name": "calc", "parameters": {"expr": "2*3"}}; '
                   '{"name": "add", "arguments": {"a": 1, "b": [2]}}',
    "mistral": 'Two.[TOOL_CALLS]calc[ARGS]{"expr": "2*3"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": [2]}',
    "pythonic": 'Two. [calc(expr="2*3"), add(a=1, b=[2])]',
}
MALFORMED = {
    "hermes": ['<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}</tool_call>',
               '<tool_call>{"arguments": {}}</tool_call>'],
    "llama3_json": ['<|python_tag|>{"name": "calc", "parameters": {"expr": "2*3"}',  # brace
                    '<|python_tag|>{"name": "calc", "parameters": [1]}',  # not an object
                    '{"name": "calc", "parameters": {}, "arguments": {}}',  # both spellings
                    '{"name": "calc", "parameters": {}}; {"name": 3, "parameters": {}}'],
    "mistral": ['[TOOL_CALLS][{"name": "calc", "arguments": {"expr": "2*3"}}',  # bracket
                '[TOOL_CALLS][{"name": "calc"}]', '[TOOL_CALLS][]',  # no arguments, no call
                '[TOOL_CALLS]calc[ARGS]{"expr": ', '[TOOL_CALLS]not a name[ARGS]{}',
                '[TOOL_CALLS]calc[ARGS]{}[TOOL_CALLS]oops',  # a later call broken
                '[{"name": "calc", "args": {}}]'],
    "pythonic": ['[calc(expr="2*3")', '[calc("2*3")]', '[calc(expr=os.system("x"))]',
                 '[calc(**kw)]', '[calc(x=1)] and [f(y=lambda: 1)]'],
}


def test_every_registered_parser_is_tested():
    assert set(TOOL_PARSERS) == set(WELL_FORMED) == set(SEVERAL) == set(MALFORMED)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_well_formed_call(name):
    text, _ = WELL_FORMED[name]
    content, calls = tool_parser(name).parse(text)
    assert content is None and len(calls) == 1
    assert fn(calls[0]) == ("calc", {"expr": "2*3"})
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["arguments"] == '{"expr":"2*3"}'  # compact, as OpenAI sends
    assert tool_parser(name).attempted(text)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_several_calls_with_text_before(name):
    content, calls = tool_parser(name).parse(SEVERAL[name])
    assert content == "Two."
    assert [fn(c) for c in calls] == [("calc", {"expr": "2*3"}), ("add", {"a": 1, "b": [2]})]


@pytest.mark.parametrize("name,text", [(n, t) for n, ts in MALFORMED.items() for t in ts])
def test_malformed_calls_stay_plain_content(name, text):
    assert tool_parser(name).parse(text) == (text, None)
    assert tool_parser(name).attempted(text)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("text", ["42", "The set {1, 2} has [2] items.", ""])
def test_plain_text_is_content(name, text):
    assert tool_parser(name).parse(text) == (text, None)


def test_llama3_json_skips_prose_braces_and_keeps_text_after():
    text = 'Use {x} here: {"name": "calc", "parameters": {"expr": "1"}} then see.'
    content, calls = tool_parser("llama3_json").parse(text)
    assert content == "Use {x} here: then see." and fn(calls[0]) == ("calc", {"expr": "1"})


def test_pythonic_reads_dotted_names_and_literals_never_runs_them():
    content, calls = tool_parser("pythonic").parse("[ns.f(a=None, b={'k': (1, 2)}, c=-1.5)]")
    assert content is None
    assert fn(calls[0]) == ("ns.f", {"a": None, "b": {"k": [1, 2]}, "c": -1.5})


def test_mistral_forms_by_tokenizer_version():
    """Pre-v11 array, v11 `name[ARGS]{}` with or without [ARGS] and with a call id, text after
    the calls; the array without its marker (a decode that dropped it) still parses, the v11
    form without markers is prose."""
    p = tool_parser("mistral")
    for text in ('[TOOL_CALLS] [{"name": "calc", "arguments": {"expr": "2*3"}}]',
                 '[TOOL_CALLS]calc{"expr": "2*3"}',
                 '[TOOL_CALLS]calc[CALL_ID]a1B2c3D4e[ARGS]{"expr": "2*3"}',
                 ' [{"name": "calc", "arguments": "{\\"expr\\": \\"2*3\\"}"}]'):
        content, calls = p.parse(text)
        assert content is None and [fn(c) for c in calls] == [("calc", {"expr": "2*3"})], text
    assert p.parse('Sure.[TOOL_CALLS]calc[ARGS]{"expr": "1"} Done.')[0] == "Sure. Done."
    assert p.parse('calc{"expr": "2*3"}') == ('calc{"expr": "2*3"}', None)


def test_unknown_tool_parser_lists_the_allowed():
    with pytest.raises(ValueError, match="allowed: hermes, llama3_json, mistral, pythonic"):
        tool_parser("granite")


# ---- reasoning parsers --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text,expected", [
    ("<think>add 2 and 3</think>5", ("add 2 and 3", "5")),
    ("add 2 and 3</think>5", ("add 2 and 3", "5")),  # the template opened <think>
    ("</think>5", (None, "5")),
    ("<think>still thinking", ("still thinking", None)),  # cut off mid-thought
    ("no tags at all", ("no tags at all", None)),
])
def test_think_parsers(name, text, expected):
    assert reasoning_parser(name).split(text) == expected


def test_qwen3_with_thinking_off_reads_untagged_text_as_content():
    qwen3, r1 = reasoning_parser("qwen3"), reasoning_parser("deepseek_r1")
    assert qwen3.split("5", OFF) == (None, "5")
    assert qwen3.split("5", {"enable_thinking": True}) == ("5", None)
    assert r1.split("5", OFF) == ("5", None)  # R1 cannot switch thinking off
    assert qwen3.split("a</think>5", OFF) == ("a", "5")


def test_none_and_unknown_reasoning_parsers():
    assert reasoning_parser(None) is None and reasoning_parser("none") is None
    with pytest.raises(ValueError, match="allowed: none, deepseek_r1, qwen3"):
        reasoning_parser("r1")


def test_tool_calls_are_read_from_the_content_after_the_reasoning():
    chat = ChatOptions(reasoning_parser="deepseek_r1", tool_parser="llama3_json")
    considered = '{"name": "drop_table", "parameters": {}}'
    reply = chat.read_reply(f"maybe {considered}?</think>"
                            '{"name": "calc", "parameters": {"expr": "2*3"}}', parse_tools=True)
    assert reply.reasoning == f"maybe {considered}?" and reply.content is None
    assert [fn(c) for c in reply.tool_calls] == [("calc", {"expr": "2*3"})]
    msg = reply.message()
    assert msg["reasoning_content"] == msg["reasoning"] == reply.reasoning
    # without tools in the request nothing is parsed; a malformed call is counted
    assert chat.read_reply("x</think>{}", parse_tools=False).tool_calls is None
    assert chat.read_reply("x</think>It is 5.", True).malformed_tool_call is False
    assert chat.read_reply('x</think>{"name": "calc"}', True).malformed_tool_call  # no params
    assert chat.read_reply('x</think><|python_tag|>{"name"', True).malformed_tool_call


# ---- config -------------------------------------------------------------------------------------

@pytest.mark.parametrize("override,message", [
    ("model.tool_parser=granite", "model.tool_parser: 'granite' is unknown; allowed: hermes, "
                                  "llama3_json, mistral, pythonic"),
    ("model.reasoning_parser=r1", "model.reasoning_parser: 'r1' is unknown; allowed: none, "
                                  "deepseek_r1, qwen3"),
    ("model.chat_template_kwargs={tokenize: true}", "model.chat_template_kwargs: 'tokenize' is "
                                                    "reserved by apply_chat_template"),
])
def test_config_refuses_unknown_names_at_load(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        TrainRunConfig.load(None, [override])


def test_config_forms():
    cfg = TrainRunConfig.load(None, ["model.reasoning_parser=none", "model.tool_parser=pythonic",
                                     "model.chat_template_kwargs.enable_thinking=false"])
    assert cfg.model.reasoning_parser is None and cfg.model.tool_parser == "pythonic"
    assert cfg.model.template_kwargs({"x": 1}) == {"enable_thinking": False, "x": 1}
    assert cfg.model.template_kwargs({"enable_thinking": True}) == {"enable_thinking": True}
    with pytest.raises(ValueError, match="'tools' is reserved"):
        cfg.model.template_kwargs({"tools": []})


# ---- template variables reach every prompt the job renders --------------------------------------

def thinking_off(tok, ids) -> bool:
    """Whether a prompt ends with the closed empty think block (rendered with thinking off)."""
    text = tok.decode(ids)
    assert text.endswith(("<think>\n\n</think>\n\n", "<think>\n")), text
    return text.endswith("</think>\n\n")


def test_render_chat_passes_template_variables(tok):
    assert not thinking_off(tok, encode_chat_prompt(tok, ROW["messages"]))
    assert thinking_off(tok, encode_chat_prompt(tok, ROW["messages"], template_kwargs=OFF))
    with pytest.raises(ValueError, match="'add_generation_prompt' is reserved"):
        render_chat(tok, ROW["messages"], template_kwargs={"add_generation_prompt": False})


def test_workflows_render_prompts_with_the_model_template_variables(tok):
    asyncio.run(_workflows_render_prompts(tok))


async def _workflows_render_prompts(tok):
    chat = ChatOptions(chat_template_kwargs=OFF)
    engine = ScriptedEngine(tok, lambda req: "4")  # a wrong answer: multi_turn retries once
    g = GenerationConfig(n_samples=2, max_new_tokens=4)
    reward = lambda text, data: float(text.strip() == data["answer"])  # noqa: E731
    await RLVRWorkflow(reward, g, tok, chat=chat).arun_episode(engine, ROW)
    mt = MultiTurnWorkflow(reward, g, tok, MultiTurnConfig(max_turns=2), chat=chat)
    await mt.arun_episode(engine, ROW)
    env = AgentEnvWorkflow(lambda d: ChatAgent(tok, g, chat=chat), ArithmeticEnv,
                           AgentEnvConfig(max_steps=1))
    await env.arun_episode(engine, ROW)
    await evaluate(engine, tok, [ROW], reward, EvalConfig(), chat=chat)
    assert len(engine.requests) == 2 + 2 + 1 + 1
    assert all(thinking_off(tok, r.input_ids) for r in engine.requests)
    engine.requests.clear()
    await RLVRWorkflow(reward, g, tok).arun_episode(engine, ROW)  # default: no variables
    assert not any(thinking_off(tok, r.input_ids) for r in engine.requests)


def test_sft_prompts_use_the_template_variables(tok):
    (plain,), (off,) = build_examples(tok, [ROW]), build_examples(tok, [ROW], OFF)
    assert not thinking_off(tok, [t for t, m in zip(plain.input_ids, plain.loss_mask) if not m])
    assert thinking_off(tok, [t for t, m in zip(off.input_ids, off.loss_mask) if not m])


def test_rlvr_reward_reads_the_answer_but_trains_on_every_token(tok):
    asyncio.run(_rlvr_reward(tok))


async def _rlvr_reward(tok):
    engine = ScriptedEngine(tok, lambda req: "2+3 is 5, not 4.</think>5")
    seen = []

    def reward(text, data):
        seen.append(text)
        return float(text.strip() == data["answer"])

    g = GenerationConfig(n_samples=1, max_new_tokens=64)
    chat = ChatOptions(reasoning_parser="qwen3")
    traj = await RLVRWorkflow(reward, g, tok, chat=chat).arun_episode(engine, ROW)
    full = await RLVRWorkflow(reward, g, tok, chat=chat,
                              reward_sees_reasoning=True).arun_episode(engine, ROW)
    assert seen == ["5", "2+3 is 5, not 4.</think>5"]
    assert [traj.samples[0].reward, full.samples[0].reward] == [1.0, 0.0]
    sample = traj.samples[0]
    out = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert tok.decode(out) == "2+3 is 5, not 4.</think>5<|im_end|>"  # the whole reply is trained


GOT: dict = {}


def chat_workflow(tokenizer, chat, gconfig):
    """A factory a config names (`workflow: {path: test_chat_parsers:chat_workflow}`)."""
    GOT.update(tokenizer=tokenizer, chat=chat)
    return RLVRWorkflow(lambda t, d: 0.0, gconfig, tokenizer, chat=chat)


def test_a_custom_workflow_factory_gets_the_model_chat_options(tok):
    from asyncrl.launch.workflows import WorkflowContext

    cfg = TrainRunConfig.load(None, ["model.reasoning_parser=qwen3",
                                     "workflow.path=test_chat_parsers:chat_workflow"])
    ctx = WorkflowContext(tok, ScriptedEngine(tok, []), None, cfg.gconfig, cfg.model, cfg.eval)
    wf = cfg.workflow.build(ctx)
    assert GOT["chat"] is cfg.model and wf.chat.reasoning_parser == "qwen3"