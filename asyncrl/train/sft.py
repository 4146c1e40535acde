"""Supervised fine-tuning on (prompt, answer) rows: the warm start RL begins from.

Rows are chat-formatted (`messages` + `answer`); the loss covers only the assistant's reply and its
EOS. A row with a `conversation` (a whole OpenAI message list, tool calls included) is trained on
every assistant turn instead (train/sft_conversation.py). Batches are drawn with a seeded
generator, so a run is reproducible from its config.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
import torch

from asyncrl.config import Config
from asyncrl.models.chat import encode_chat_prompt, encode_completion
from asyncrl.train.logprobs import gather_logprobs
from asyncrl.train.losses import sft_loss
from asyncrl.train.optim import OptimizerConfig, build_optimizer
from asyncrl.train.sft_conversation import conversation_ids


class SFTConfig(Config):
    steps: int = pydantic.Field(300, ge=1)  # optimizer steps
    batch_size: int = pydantic.Field(64, ge=1)  # rows per step
    eval_every: int = pydantic.Field(0, ge=0, description="0 = evaluate only at the end")
    eval_size: int = pydantic.Field(256, ge=1)  # held-out rows of the greedy accuracy eval
    eval_max_new_tokens: int = pydantic.Field(16, ge=1)  # generation limit of the eval
    log_every: int = pydantic.Field(10, ge=1)  # steps between log lines
    seed: int = 0  # row order and label noise
    # Systematically biased demonstrations: this fraction of training rows (chosen by a seeded
    # hash of the row id) shows integer answers shifted by `label_noise_offset`. A model trained
    # on them knows the arithmetic but has learned a wrong habit, which a verifier-driven RL
    # run can correct; 0 trains on clean labels. Held-out evaluation always uses true answers.
    label_noise: float = pydantic.Field(0.0, ge=0.0, le=1.0)
    label_noise_offset: int = 1  # how far the noisy answers are shifted
    # As in the train engine: bf16 autocast keeps fp32 master weights and optimizer state; on a
    # CPU with AVX512-BF16 it makes a tiny-model step ~1.5x faster.
    autocast_dtype: Literal["none", "bfloat16"] = "none"


@dataclass
class SFTExample:
    input_ids: list[int]
    target_mask: list[int]  # 1 where the token is part of the reply (predicted, trained on)


def reply_text(row: dict[str, Any]) -> str:
    """What the assistant should answer: worked solution + final answer when a row has one."""
    if row.get("solution"):
        return f"{row['solution'].rstrip()}\n#### {row['answer']}"
    return str(row["answer"])


def _noisy(row_id: Any, seed: int, fraction: float) -> bool:
    digest = hashlib.sha256(f"{seed}:{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def with_label_noise(rows: list[dict[str, Any]], fraction: float, offset: int,
                     seed: int = 0) -> list[dict[str, Any]]:
    """Copies of `rows` where a seeded `fraction` of integer answers is shifted by `offset`.

    Conversation rows are left alone: their demonstrations are the messages themselves, so a data
    generator builds any imperfection into them (examples/tool_agent/make_data.py does).
    """
    if fraction <= 0:
        return list(rows)
    out = []
    for row in rows:
        answer = str(row["answer"]).strip()
        if (row.get("conversation") is None and answer.lstrip("-").isdigit()
                and _noisy(row.get("id"), seed, fraction)):
            row = {**row, "answer": str(int(answer) + offset)}
        out.append(row)
    return out


def build_examples(tokenizer: Any, rows: list[dict[str, Any]],
                   template_kwargs: dict[str, Any] | None = None) -> list[SFTExample]:
    """`template_kwargs`: the model's chat template variables (model.chat_template_kwargs),
    so SFT trains on the prompts rollouts will render."""
    out = []
    for row in rows:
        if row.get("conversation") is not None:
            out.append(SFTExample(*conversation_ids(tokenizer, row, template_kwargs)))
            continue
        prompt = encode_chat_prompt(tokenizer, row["messages"], template_kwargs=template_kwargs)
        reply = encode_completion(tokenizer, reply_text(row))
        out.append(SFTExample(prompt + reply, [0] * len(prompt) + [1] * len(reply)))
    return out


def collate(examples: list[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch; `label_mask[t]` says whether position t's next token is trained on."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    tmask = torch.zeros((len(examples), width), dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        tmask[i, :n] = torch.tensor(e.target_mask)
        attn[i, :n] = 1
    labels = torch.roll(ids, -1, dims=1)
    label_mask = torch.roll(tmask, -1, dims=1)
    label_mask[:, -1] = 0
    return {"input_ids": ids, "attention_mask": attn, "labels": labels, "label_mask": label_mask}


def sft_step(model, batch: dict[str, torch.Tensor], opt, sched, grad_clip: float | None,
             autocast_dtype: str = "none") -> dict:
    model.train()
    device = batch["input_ids"].device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast_dtype == "bfloat16"):
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits
    logp = gather_logprobs(logits, batch["labels"])
    normalizer = batch["label_mask"].sum().clamp(min=1)
    loss, stats = sft_loss(logp, batch["label_mask"], normalizer)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip is not None:
        stats["sft/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    opt.step()
    sched.step()
    stats["sft/loss"] = float(loss.detach())
    stats["sft/lr"] = sched.get_last_lr()[0]
    return stats


def train_sft(
    model,
    examples: list[SFTExample],
    cfg: SFTConfig,
    opt_cfg: OptimizerConfig,
    pad_id: int,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Run cfg.steps optimizer steps; `on_step(step, stats)` drives progress, logging and eval."""
    if not examples:
        raise ValueError("SFT needs at least one training example; the train split is empty")
    gen = torch.Generator().manual_seed(cfg.seed)
    opt, sched = build_optimizer(model.parameters(), opt_cfg, cfg.steps)
    history = []
    t0 = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        idx = torch.randint(len(examples), (cfg.batch_size,), generator=gen).tolist()
        stats = sft_step(model, collate([examples[i] for i in idx], pad_id), opt, sched,
                         opt_cfg.grad_clip, cfg.autocast_dtype)
        stats["time/elapsed_s"] = time.perf_counter() - t0
        history.append(stats)
        if on_step is not None:
            on_step(step, stats)
    return history
