"""Pure parts of the proxy: tool-call parsing, reward assignment and discounting, exports,
prompt reuse with the real tiny byte tokenizer and chat template."""

import json

import pytest

from asyncrl.api import StopReason
from asyncrl.models.chat import render_chat
from asyncrl.models.tokenizer import build_byte_tokenizer
from asyncrl.proxy.errors import NotFoundError
from asyncrl.proxy.export import export_concat, export_individual, export_session
from asyncrl.proxy.prompt_reuse import build_prompt
from asyncrl.proxy.records import Completion, Session
from asyncrl.proxy.tool_calls import parse_tool_calls
from asyncrl.reward.returns import raw_rewards, session_returns


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


# ---- tool calls ---------------------------------------------------------------------------------

def test_tool_call_is_parsed_with_text_around():
    content, calls = parse_tool_calls(
        'Let me compute.<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>')
    assert content == "Let me compute."
    assert len(calls) == 1 and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "calc", "arguments": '{"expr":"2*3"}'}
    assert calls[0]["id"].startswith("call_")


def test_two_calls_and_string_arguments():
    text = ('<tool_call>{"name":"a","arguments":"{\\"x\\": 1}"}</tool_call>'
            '<tool_call>{"name":"b","arguments":{}}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}</tool_call>',  # missing brace
    '<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}',  # no closing tag
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "calc", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>[]</tool_call>', "<tool_call></tool_call>", "<tool_call>",
    '<tool_call>{"name":"a","arguments":{}}</tool_call></tool_call>',  # stray tag
])
def test_malformed_calls_stay_plain_content(text):
    assert parse_tool_calls(text) == (text, None)


def test_text_without_calls_is_content():
    assert parse_tool_calls("42") == ("42", None)


# ---- rewards ------------------------------------------------------------------------------------

def test_float_reward_goes_to_last_completion_and_discounts_backwards():
    turns = [["a"], ["b"], ["c"]]
    raw = raw_rewards(turns, {}, 1.0)
    assert raw == {"a": 0.0, "b": 0.0, "c": 1.0}
    g = session_returns(turns, raw, 0.9)
    assert g == pytest.approx({"a": 0.81, "b": 0.9, "c": 1.0})


def test_dict_rewards_and_discounting_by_hand():
    turns = [["a"], ["b"], ["c"]]
    raw = raw_rewards(turns, {"a": 0.5, "c": 2.0}, None)
    g = session_returns(turns, raw, 0.5)
    # c: 2; b: 0 + 0.5*2 = 1; a: 0.5 + 0.5*1 = 1
    assert g == pytest.approx({"a": 1.0, "b": 1.0, "c": 2.0})


def test_turn_discount_one_and_zero():
    turns = [["a"], ["b"]]
    raw = {"a": 0.25, "b": 1.0}
    assert session_returns(turns, raw, 1.0) == pytest.approx({"a": 1.25, "b": 1.0})
    assert session_returns(turns, raw, 0.0) == pytest.approx(raw)


def test_choices_of_one_turn_feed_the_mean_back():
    turns = [["a"], ["b:0", "b:1"]]
    raw = raw_rewards(turns, {"b:0": 1.0}, None)
    g = session_returns(turns, raw, 1.0)
    assert g == pytest.approx({"a": 0.5, "b:0": 1.0, "b:1": 0.0})


def test_unknown_completion_and_bad_discount_are_errors():
    with pytest.raises(KeyError, match="zzz"):
        raw_rewards([["a"]], {"zzz": 1.0}, None)
    with pytest.raises(ValueError, match="turn_discount=1.5 is out of range"):
        session_returns([["a"]], {"a": 0.0}, 1.5)


def test_session_reward_keys_resolve_choices():
    s = Session(id="s", secret="x")
    s.add_turn([_rec("r1", 0, [1], [2])])
    s.add_turn([_rec("r2:0", 1, [1], [3]), _rec("r2:1", 1, [1], [4])])
    s.set_reward({"r2": 1.0})
    assert s.rewards == {"r2:0": 1.0, "r2:1": 1.0}
    with pytest.raises(NotFoundError, match="not in this session"):
        s.set_reward({"other-session-id": 1.0})


# ---- exports ------------------------------------------------------------------------------------

def _rec(cid, turn, prompt, out, parent=None):
    return Completion(cid, turn, list(prompt), list(out), [-0.1 * (i + 1) for i in range(len(out))],
                      [turn] * len(out), StopReason.STOP, [], None, {"content": ""}, parent)


def test_individual_export_is_exact():
    a = _rec("a", 0, [5, 6], [7, 8])
    b = _rec("b", 1, [5, 6, 7, 8, 9], [10])
    samples = export_individual([a, b], {"a": 0.9, "b": 1.0})
    assert samples[0].input_ids == [5, 6, 7, 8] and samples[0].loss_mask == [0, 0, 1, 1]
    assert samples[0].logprobs == [0.0, 0.0, -0.1, -0.2] and samples[0].versions == [-1, -1, 0, 0]
    assert samples[1].input_ids == [5, 6, 7, 8, 9, 10]
    assert samples[1].loss_mask == [0, 0, 0, 0, 0, 1] and samples[1].reward == 1.0


def test_concat_export_masks_every_turn_of_each_leaf():
    # a -> b -> c and a -> d: two leaves (c, d) share the first turn.
    a = _rec("a", 0, [1, 2], [3, 4])
    b = _rec("b", 1, [1, 2, 3, 4, 20], [5], parent="a")
    c = _rec("c", 2, [1, 2, 3, 4, 20, 5, 21, 22], [6, 7], parent="b")
    d = _rec("d", 3, [1, 2, 3, 4, 30], [8], parent="a")
    raw = {"a": 0.0, "b": 0.5, "c": 1.0, "d": 0.0}
    returns = {"a": 1.5, "b": 1.5, "c": 1.0, "d": 0.0}
    samples = export_concat([a, b, c, d], raw, returns)
    assert len(samples) == 2
    s_c, s_d = samples
    assert s_c.input_ids == [1, 2, 3, 4, 20, 5, 21, 22, 6, 7]
    assert s_c.loss_mask == [0, 0, 1, 1, 0, 1, 0, 0, 1, 1]
    assert s_c.logprobs == [0, 0, -0.1, -0.2, 0, -0.1, 0, 0, -0.1, -0.2]
    assert s_c.versions == [-1, -1, 0, 0, -1, 1, -1, -1, 2, 2]
    assert s_c.token_rewards == [0, 0, 0, 0.0, 0, 0.5, 0, 0, 0, 1.0]
    assert s_c.reward == 1.5 and s_c.metadata["completion_ids"] == ["a", "b", "c"]
    assert s_d.input_ids == [1, 2, 3, 4, 30, 8] and s_d.loss_mask == [0, 0, 1, 1, 0, 1]


def test_both_exports_carry_the_engines_routes():
    """A mixture-of-experts engine's routes (prompt + output of each completion) reach the
    samples: each completion's own, and a conversation the routes of its last turn."""
    import dataclasses

    import numpy as np

    def routed(rec):
        n = len(rec.prompt_ids) + len(rec.output_ids)
        return dataclasses.replace(rec, routes=np.arange(n * 2, dtype=np.int16).reshape(n, 1, 2))

    a = routed(_rec("a", 0, [1, 2], [3, 4]))
    b = routed(_rec("b", 1, [1, 2, 3, 4, 20], [5], parent="a"))
    (one,) = export_concat([a, b], {"a": 0.0, "b": 1.0}, {"a": 1.0, "b": 1.0})
    assert np.array_equal(one.routes, b.routes) and len(one.routes) == len(one.input_ids)
    first, second = export_individual([a, b], {"a": 1.0, "b": 1.0})
    assert np.array_equal(first.routes, a.routes) and np.array_equal(second.routes, b.routes)


def test_concat_rejects_a_parent_that_is_not_a_prefix():
    a = _rec("a", 0, [1], [2])
    b = _rec("b", 1, [1, 9, 3], [4], parent="a")
    with pytest.raises(ValueError, match="not a prefix"):
        export_concat([a, b], {"a": 0, "b": 0}, {"a": 0, "b": 0})
    with pytest.raises(ValueError, match="allowed: individual, concat"):
        export_session([a], {"a": 0}, {"a": 0}, "tree")


# ---- prompt reuse -------------------------------------------------------------------------------

def _chat_completion(tok, messages, reply_text, cid="c1", tools=None, closed=True,
                     message=None, history=()):
    prompt, parent, drift = build_prompt(tok, messages, tools, list(history))
    out = tok.encode(reply_text, add_special_tokens=False) + ([tok.eos_token_id] if closed else [])
    msg = message or {"role": "assistant", "content": reply_text}
    rec = Completion(cid, len(history), prompt, out, [-0.5] * len(out), [0] * len(out),
                     StopReason.STOP, messages, tools, msg, parent.id if parent else None, drift)
    return rec


def test_second_turn_reuses_the_exact_sampled_ids(tok):
    first = [{"role": "user", "content": "2+2?"}]
    c1 = _chat_completion(tok, first, "4")
    second = first + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "Sure?"}]
    ids, parent, drift = build_prompt(tok, second, None, [c1])
    assert parent is c1
    assert ids[:len(c1.prompt_ids) + len(c1.output_ids)] == c1.prompt_ids + c1.output_ids
    # For plain text the tiny tokenizer re-renders identically: no drift either way.
    assert ids == tok.encode(render_chat(tok, second, True), add_special_tokens=False)
    assert drift == 0


def test_tool_call_reply_keeps_the_models_spacing(tok):
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {
        "type": "object", "properties": {"expr": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "12*3?"}]
    sampled = '<tool_call>{"name": "calc", "arguments": {"expr": "12*3"}}</tool_call>'
    content, calls = parse_tool_calls(sampled)
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    c1 = _chat_completion(tok, msgs, sampled, tools=tools, message=message)
    nxt = msgs + [message, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "36"}]
    ids, parent, drift = build_prompt(tok, nxt, tools, [c1])
    assert parent is c1
    head = c1.prompt_ids + c1.output_ids
    assert ids[:len(head)] == head
    assert tok.decode(ids[len(head):]) == "\n<|im_start|>tool\n36<|im_end|>\n<|im_start|>assistant\n"
    assert drift > 0  # naive re-rendering would have trained on a re-serialised call


def test_truncated_reply_is_closed_and_edited_history_is_not_reused(tok):
    msgs = [{"role": "user", "content": "count"}]
    c1 = _chat_completion(tok, msgs, "1 2 3", closed=False)
    nxt = msgs + [{"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "go"}]
    ids, parent, _ = build_prompt(tok, nxt, None, [c1])
    head = c1.prompt_ids + c1.output_ids
    assert parent is c1 and ids[:len(head)] == head
    assert tok.decode(ids[len(head):]).startswith("<|im_end|>\n<|im_start|>user\ngo")
    edited = msgs + [{"role": "assistant", "content": "1 2"}, {"role": "user", "content": "go"}]
    ids, parent, drift = build_prompt(tok, edited, None, [c1])
    assert parent is None and drift == 0
    assert ids == tok.encode(render_chat(tok, edited, True), add_special_tokens=False)
