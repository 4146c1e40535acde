"""Chat options over real HTTP with the real `openai` client: template variables (configured,
and a request's own `chat_template_kwargs` over them), `reasoning_content`, and tool calls by
parser name, through the proxy and through `asyncrl serve` (a real subprocess).

Proxy replies come from the scripted engine of the proxy tests: an untrained tiny model never
writes a well-formed Llama-3 call or a think block; the server runs the real tiny model.
"""

import copy
import json
import shutil

import httpx
import openai
import pytest

from asyncrl.models.chat import encode_chat_prompt
from asyncrl.models.chat_options import ChatOptions
from asyncrl.models.loading import load_tokenizer
from asyncrl.models.tokenizer import save_tokenizer
from tests.conftest import running_servers
from tests.proxy_helpers import ScriptedEngine, serving
from tests.test_chat_parsers import OFF, THINKING_TEMPLATE, thinking_off

ADMIN = {"Authorization": "Bearer admin-secret"}
MSGS = [{"role": "user", "content": "2*3="}]
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic",
          "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def thinking_dir(model_dir, tmp_path_factory):
    """A copy of the tiny model whose chat template branches on `enable_thinking`."""
    out = tmp_path_factory.mktemp("thinking") / "tiny"
    shutil.copytree(model_dir, out)
    tok = load_tokenizer(out)
    tok.chat_template = THINKING_TEMPLATE
    save_tokenizer(tok, out)
    return out


@pytest.fixture(scope="module")
def tok(thinking_dir):
    return load_tokenizer(thinking_dir)


def session_client(proxy) -> tuple[openai.OpenAI, str]:
    r = httpx.post(f"{proxy.url}/sessions", headers=ADMIN)
    assert r.status_code == 200, r.text
    return openai.OpenAI(base_url=proxy.base_url, api_key=r.json()["api_key"],
                         max_retries=0), r.json()["session_id"]


def exported(proxy, sid) -> list[dict]:
    r = httpx.post(f"{proxy.url}/sessions/{sid}/export", headers=ADMIN, json={})
    assert r.status_code == 200, r.text
    return r.json()["samples"]


# ---- the proxy ----------------------------------------------------------------------------------

def test_proxy_template_kwargs_default_and_request_override(tok):
    engine = ScriptedEngine(tok, lambda req: "6")
    chat = ChatOptions(chat_template_kwargs=OFF)
    with serving(engine, tok, chat=chat) as (proxy, _):
        client, _ = session_client(proxy)
        client.chat.completions.create(model="m", messages=MSGS, max_tokens=8)
        client.chat.completions.create(model="m", messages=MSGS, max_tokens=8,
                                       extra_body={"chat_template_kwargs":
                                                   {"enable_thinking": True}})
        with pytest.raises(openai.BadRequestError, match="'tools' is reserved"):
            client.chat.completions.create(model="m", messages=MSGS, max_tokens=8,
                                           extra_body={"chat_template_kwargs": {"tools": []}})
    off, on = (r.input_ids for r in engine.requests)
    assert off == encode_chat_prompt(tok, MSGS, template_kwargs=OFF) and thinking_off(tok, off)
    assert on == encode_chat_prompt(tok, MSGS) and not thinking_off(tok, on)


def test_proxy_reasoning_and_llama3_tool_calls(tok):
    """The model thinks (the template opened `<think>`), then writes a Llama-3 JSON call: the
    client gets reasoning_content and tool_calls; the export keeps every sampled token."""
    reply = ('6? A call in thought {"name": "rm", "parameters": {}} is not made.</think>'
             '<|python_tag|>{"name": "calc", "parameters": {"expr": "2*3"}}')
    engine = ScriptedEngine(tok, lambda req: reply)
    chat = ChatOptions(reasoning_parser="qwen3", tool_parser="llama3_json")
    with serving(engine, tok, chat=chat) as (proxy, _):
        client, sid = session_client(proxy)
        out = client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS,
                                             max_tokens=200)
        streamed = list(client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS,
                                                       max_tokens=200, stream=True))
        samples = exported(proxy, sid)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("calc", {"expr": "2*3"})]
    thought = '6? A call in thought {"name": "rm", "parameters": {}} is not made.'
    extra = choice.message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == thought
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == thought
    assert [tc.function.name for d in deltas for tc in d.tool_calls or []] == ["calc"]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    prompt_len = len(encode_chat_prompt(tok, MSGS, TOOLS))
    trained = samples[0]["input_ids"][prompt_len:]
    assert tok.decode(trained) == reply + "<|im_end|>"  # reasoning and call: all trained on
    assert samples[0]["metadata"]["tool_calls"] == 1


def test_proxy_malformed_llama3_call_is_content(tok):
    bad = '<|python_tag|>{"name": "calc", "parameters": {"expr": "2*3"}'
    engine = ScriptedEngine(tok, lambda req: bad)
    with serving(engine, tok, chat=ChatOptions(tool_parser="llama3_json")) as (proxy, _):
        client, _ = session_client(proxy)
        out = client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS,
                                             max_tokens=200)
        stats = httpx.get(f"{proxy.url}/stats", headers=ADMIN).json()
    assert out.choices[0].message.content == bad and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop" and stats["malformed_tool_calls"] == 1


def test_proxy_mistral_calls_survive_decoding_without_special_tokens(tok):
    """Mistral's `[TOOL_CALLS]`/`[ARGS]` are special tokens (here added to a copy of the tiny
    tokenizer, as in Mistral's): a plain decode drops them, so the proxy decodes a reply whose
    calls it parses keeping the parser's markers; the client sees only the calls."""
    mistral = copy.deepcopy(tok)
    mistral.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    reply = 'Computing.[TOOL_CALLS]calc[ARGS]{"expr": "2*3"}[TOOL_CALLS]calc[ARGS]{"expr": "1"}'
    ids = mistral.encode(reply, add_special_tokens=False)
    assert mistral.decode(ids, skip_special_tokens=True) == \
        'Computing.calc{"expr": "2*3"}calc{"expr": "1"}'  # what the markers would leave
    engine = ScriptedEngine(mistral, lambda req: reply)
    with serving(engine, mistral, chat=ChatOptions(tool_parser="mistral")) as (proxy, _):
        client, sid = session_client(proxy)
        out = client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS,
                                             max_tokens=200)
        plain = client.chat.completions.create(model="m", messages=MSGS, max_tokens=200)
        samples = exported(proxy, sid)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Computing."
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("calc", {"expr": "2*3"}), ("calc",
                                                                                {"expr": "1"})]
    # without tools nothing is parsed, and the markers stay out of the text as usual
    assert plain.choices[0].message.content == 'Computing.calc{"expr": "2*3"}calc{"expr": "1"}'
    prompt_len = len(encode_chat_prompt(mistral, MSGS, TOOLS))
    assert samples[0]["input_ids"][prompt_len:] == ids + [mistral.eos_token_id]


# ---- asyncrl serve ------------------------------------------------------------------------------

def test_serve_chat_options_from_vllm_style_flags(thinking_dir, tok, one_thread):
    """`--default-chat-template-kwargs` and a request's override render different prompts (the
    usage counts the engine's prompt ids); with qwen3 and thinking on, an untrained model's
    reply has no `</think>`, so it is all reasoning; with thinking off all content."""
    flags = ["--default-chat-template-kwargs", json.dumps(OFF), "--reasoning-parser", "qwen3",
             "--tool-parser", "llama3_json", "engine.max_seq_len=256", "engine.num_threads=1"]
    with running_servers(thinking_dir, 1, *flags) as [(url, _)]:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        off = client.chat.completions.create(model="m", messages=MSGS, max_tokens=6, seed=1)
        on = client.chat.completions.create(model="m", messages=MSGS, max_tokens=6, seed=1,
                                            extra_body={"chat_template_kwargs":
                                                        {"enable_thinking": True}})
        stream = list(client.chat.completions.create(
            model="m", messages=MSGS, max_tokens=6, seed=1, stream=True,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}}))
        with pytest.raises(openai.BadRequestError, match="reserved"):
            client.chat.completions.create(model="m", messages=MSGS, max_tokens=6,
                                           extra_body={"chat_template_kwargs": {"tokenize": 1}})
    assert off.usage.prompt_tokens == len(encode_chat_prompt(tok, MSGS, template_kwargs=OFF))
    assert on.usage.prompt_tokens == len(encode_chat_prompt(tok, MSGS))
    assert on.usage.prompt_tokens != off.usage.prompt_tokens
    assert off.choices[0].message.content and "reasoning_content" not in (
        off.choices[0].message.model_extra or {})
    thought = on.choices[0].message.model_extra["reasoning_content"]
    assert thought and on.choices[0].message.content is None
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == thought


def test_serve_refuses_an_unknown_tool_parser(model_dir):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "serve", "--model",
                           str(model_dir), "--tool-parser", "granite"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "tool_parser: 'granite' is unknown; allowed: hermes, llama3_json, mistral, pythonic" \
        in proc.stderr


# ---- the training path --------------------------------------------------------------------------

SEEN: list[str] = []


def record_reward(completion: str, row: dict) -> float:
    SEEN.append(completion)
    return float(len(SEEN) % 2)  # varies, so groups are not uniform


@pytest.mark.parametrize("thinking", [False, True])
def test_trainer_renders_with_model_options_and_rewards_the_answer(thinking_dir, tok, tmp_path,
                                                                   thinking, one_thread):
    """`asyncrl train`'s Trainer: rollouts are rendered with model.chat_template_kwargs and, with
    model.reasoning_parser qwen3, the reward reads the answer after the reasoning. An untrained
    model never writes `</think>`: with thinking on, its whole reply is reasoning (the reward
    reads ""), while every sampled token is still trained on."""
    from asyncrl import Trainer
    from tests.test_train_loop import small_config

    SEEN.clear()
    cfg = small_config(thinking_dir, tmp_path / "run", **{
        "model.chat_template_kwargs": {"enable_thinking": thinking},
        "model.reasoning_parser": "qwen3", "total_steps": 1, "eval.every": 0,
        "rollout.dump_dir": str(tmp_path / "dump")})
    assert Trainer(cfg).train(reward=record_reward).steps == 1
    records = [json.loads(line) for f in sorted((tmp_path / "dump").glob("*.jsonl"))
               for line in f.read_text().splitlines()]
    assert records and SEEN
    for rec in records:
        prompt = [t for t, m in zip(rec["input_ids"], rec["loss_mask"]) if not m]
        assert thinking_off(tok, prompt) is (not thinking)
        assert sum(rec["loss_mask"]) >= 1
    if thinking:
        assert set(SEEN) == {""}
    else:
        assert any(SEEN)
