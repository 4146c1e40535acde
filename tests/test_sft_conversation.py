"""Conversation SFT rows: which tokens are trained on, template checks, file loading, eval."""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl.data.files import FileDatasetConfig
from asyncrl.data.split import DatasetError
from asyncrl.errors import UserError
from asyncrl.launch import sft as sft_launch
from asyncrl.models.tiny import build_tiny_model_in_memory
from asyncrl.models.tokenizer import CHAT_TEMPLATE, IM_END_ID, IM_START_ID, build_byte_tokenizer
from asyncrl.launch.sft_config import SFTRunConfig
from asyncrl.train.config import OptimizerConfig, SFTConfig, TrainEngineConfig
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.sft import build_examples, train_sft, with_label_noise
from asyncrl.train.sft_conversation import assistant_spans, conversation_ids, first_turn

from conftest import TINY

TOOLS = [{"type": "function", "function": {
    "name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "calc", "arguments": '{"expr":"12*34"}'}}
TOOL_ROW = {"id": "t1", "question": "12*34", "answer": "408", "tools": TOOLS, "conversation": [
    {"role": "user", "content": "12*34=?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "408"},
    {"role": "assistant", "content": "408"},
]}
CALL_TEXT = '<tool_call>{"name":"calc","arguments":{"expr":"12*34"}}</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def runs(tok, ids, mask, flag):
    """Decoded maximal runs of tokens whose mask equals `flag`."""
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m == flag:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    return out + ([tok.decode(cur)] if cur else [])


def test_mask_of_a_two_message_conversation_by_hand(tok):
    ids, mask = conversation_ids(tok, {"id": "r", "conversation": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    # <s>user\na</s>\n<s>assistant\nb</s>\n ; the char ids are ord(c) - 32 + 6, "\n" is 5.
    def c(text):
        return [5 if ch == "\n" else ord(ch) - 32 + 6 for ch in text]
    assert ids == ([IM_START_ID, *c("user\na"), IM_END_ID, *c("\n"), IM_START_ID,
                    *c("assistant\n"), *c("b"), IM_END_ID, *c("\n")])
    assert mask == [0] * 20 + [1, 1, 0]  # "b" and <|im_end|>; not the "\n" after it


def test_tool_conversation_trains_on_both_assistant_turns_only(tok):
    ids, mask = conversation_ids(tok, TOOL_ROW)
    full = tok.apply_chat_template(TOOL_ROW["conversation"], tools=TOOLS, tokenize=False)
    assert tok.decode(ids) == full and ids == tok.encode(full)
    assert runs(tok, ids, mask, 1) == [CALL_TEXT, "408<|im_end|>"]
    assert runs(tok, ids, mask, 0) == [
        "<|im_start|>system\n# Tools\ncalc(expr)<|im_end|>\n"
        "<|im_start|>user\n12*34=?<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n",
        "\n",
    ]


def test_conversation_ending_in_a_malformed_call_and_first_turn(tok):
    row = {"id": "m", "tools": TOOLS, "conversation": [
        {"role": "user", "content": "1*2=?"},
        {"role": "assistant", "content": '<tool_call>{"name":"calc","arguments":{"expr":"1*2"}'}]}
    ids, mask = conversation_ids(tok, row)
    assert runs(tok, ids, mask, 1) == ['<tool_call>{"name":"calc","arguments":{"expr":"1*2"}'
                                       "<|im_end|>"]
    prompt, target = first_turn(tok, TOOL_ROW)
    assert tok.decode(prompt).endswith("12*34=?<|im_end|>\n<|im_start|>assistant\n")
    assert target == CALL_TEXT


def test_build_examples_mixes_row_kinds_and_label_noise_skips_conversations(tok):
    plain = {"id": "p", "question": "1+1", "answer": "2",
             "messages": [{"role": "user", "content": "1+1"}]}
    ex_plain, ex_conv = build_examples(tok, [plain, TOOL_ROW])
    assert tok.decode(ex_plain.input_ids) == ("<|im_start|>user\n1+1<|im_end|>\n"
                                              "<|im_start|>assistant\n2<|im_end|>")
    assert sum(ex_plain.loss_mask) == 2
    assert (ex_conv.input_ids, ex_conv.loss_mask) == conversation_ids(tok, TOOL_ROW)
    noisy = with_label_noise([plain, TOOL_ROW], 1.0, 5)
    assert noisy[0]["answer"] == "7" and noisy[1] is TOOL_ROW


@pytest.mark.parametrize("template, match", [
    ("{{- messages | length -}}" + CHAT_TEMPLATE, "not prefix-stable at message 1"),
    (CHAT_TEMPLATE.replace("<|im_end|>", "<|endoftext|>"), "without the EOS token"),
])
def test_templates_that_hide_turn_boundaries_are_rejected(template, match):
    bad = build_byte_tokenizer()
    bad.chat_template = template
    with pytest.raises(UserError, match=f"row 't1'.*{match}"):
        assistant_spans(bad, TOOL_ROW)


@pytest.mark.parametrize("conversation, match", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"content": "x"}], r"conversation\[0\] must be an object with a string 'role'"),
    ([{"role": "user", "content": "x"}], "no assistant turn"),
])
def test_malformed_conversations_name_the_row(tok, conversation, match):
    with pytest.raises(ValueError, match=f"row 'bad': .*{match}"):
        conversation_ids(tok, {"id": "bad", "conversation": conversation})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_rows_pass_conversation_and_tools_through(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [TOOL_ROW, {**TOOL_ROW, "id": "t2", "tools": None}])
    rows = FileDatasetConfig(kind="jsonl", path=path, id_field="id", eval_fraction=0).build()
    first, second = rows.train_rows()
    assert first["conversation"] == TOOL_ROW["conversation"] and first["tools"] == TOOLS
    assert second.get("tools") is None
    bad = write_jsonl(tmp_path / "bad.jsonl", [{**TOOL_ROW, "conversation": [{"content": "x"}]}])
    with pytest.raises(DatasetError, match=r"bad.jsonl: row 0: field 'conversation' must be"):
        FileDatasetConfig(kind="jsonl", path=bad, id_field="id").build()


def test_eval_scores_conversation_rows_by_their_first_turn(tok, monkeypatch):
    wrong = {**TOOL_ROW, "id": "t2"}
    plain = {"id": "p", "answer": "2", "messages": [{"role": "user", "content": "1+1"}]}
    replies = [CALL_TEXT, "<tool_call>{}</tool_call><|im_end|>", "2<|im_end|>"]

    def fake_generate(model, prompts, *args, **kwargs):
        assert tok.decode(prompts[2]).endswith("1+1<|im_end|>\n<|im_start|>assistant\n")
        return [tok.encode(r) for r in replies]

    monkeypatch.setattr(sft_launch, "hf_greedy_generate", fake_generate)
    assert sft_launch.greedy_accuracy(None, tok, [TOOL_ROW, wrong, plain], 80) == pytest.approx(2 / 3)


@pytest.mark.parametrize("autocast_dtype", ["none", "bfloat16"])
def test_sft_on_conversations_lowers_the_assistant_loss(tok, autocast_dtype):
    model, _ = build_tiny_model_in_memory(TINY)
    examples = build_examples(tok, [TOOL_ROW])
    torch.manual_seed(0)
    cfg = SFTConfig(steps=40, batch_size=2)
    engine = HFTrainEngine(model, TrainEngineConfig(
        autocast_dtype=autocast_dtype, optimizer=OptimizerConfig(lr=3e-3, warmup_steps=0)),
        total_steps=cfg.steps)
    history = train_sft(engine, examples, cfg)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    assert history[0]["train/loss_tokens"] == 2 * sum(examples[0].loss_mask)
    assert history[-1]["train/loss"] < 0.5 * history[0]["train/loss"]


def test_sft_cache_key_follows_the_data_files_contents(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [TOOL_ROW])
    cfg = SFTRunConfig.from_dict({"data": {"kind": "jsonl", "path": path}})
    before = sft_launch.cache_key(cfg)
    assert sft_launch.cache_key(cfg) == before
    write_jsonl(tmp_path / "c.jsonl", [{**TOOL_ROW, "answer": "409"}])
    assert sft_launch.cache_key(cfg) != before
