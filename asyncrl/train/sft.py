"""Supervised fine-tuning on (prompt, answer) rows: the warm start RL begins from.

Rows are chat-formatted (`messages` + `answer`); the loss covers only the assistant's reply and its
EOS. A row with a `conversation` (a whole OpenAI message list, tool calls included) is trained on
every assistant turn instead (train/sft_conversation.py). Each row becomes a `Sample` whose loss
mask covers what is trained, and the steps run through the train engine (`train_sft`): the same
packing, micro-batching, precision and FSDP2 sharding as RL. Batches are drawn with a seeded
generator (the same on every rank), so a run is reproducible from its config.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncrl.api.trajectory import PROMPT_VERSION, Sample
from asyncrl.models.chat import encode_completion
from asyncrl.models.vision import VisionPromptEncoder, row_prompt
from asyncrl.train.config import SFTConfig
from asyncrl.train.engine import HFTrainEngine, sft_token_loss
from asyncrl.train.sft_conversation import conversation_ids


def demonstration(input_ids: list[int], target_mask: list[int]) -> Sample:
    """A training sequence whose `target_mask` tokens (the replies) are trained on."""
    n = len(input_ids)
    return Sample(list(input_ids), list(target_mask), [0.0] * n,
                  [0 if m else PROMPT_VERSION for m in target_mask])


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
                   template_kwargs: dict[str, Any] | None = None,
                   vision: VisionPromptEncoder | None = None) -> list[Sample]:
    """`template_kwargs`: the model's chat template variables (model.chat_template_kwargs),
    so SFT trains on the prompts rollouts will render; `vision`: a vision-language model's
    encoder, which turns a row's images into the sample's (as rollouts do)."""
    out = []
    for row in rows:
        if row.get("conversation") is not None:
            out.append(demonstration(*conversation_ids(tokenizer, row, template_kwargs)))
            continue
        prompt, images = row_prompt(tokenizer, vision, row, template_kwargs)
        reply = encode_completion(tokenizer, reply_text(row))
        sample = demonstration(prompt + reply, [0] * len(prompt) + [1] * len(reply))
        sample.images = images
        out.append(sample)
    return out


def train_sft(engine: HFTrainEngine, examples: list[Sample], cfg: SFTConfig,
              on_step: Callable[[int, dict[str, float]], None] | None = None
              ) -> list[dict[str, float]]:
    """Run cfg.steps optimizer steps of `engine` (built with total_steps=cfg.steps); every rank
    of a torchrun group calls it. `on_step(step, stats)` drives progress, logging and eval."""
    if not examples:
        raise ValueError("SFT needs at least one training example; the train split is empty")
    gen = torch.Generator().manual_seed(cfg.seed)
    history = []
    t0 = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        idx = torch.randint(len(examples), (cfg.batch_size,), generator=gen).tolist()
        stats = engine.train_batch([examples[i] for i in idx], sft_token_loss)
        stats["time/elapsed_s"] = time.perf_counter() - t0
        history.append(stats)
        if on_step is not None:
            on_step(step, stats)
    return history
