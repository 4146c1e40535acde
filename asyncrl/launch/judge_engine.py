"""The judge of `reward: {kind: judge, model_path: ...}` on the built-in engine, in this process.

The reward package cannot import the engine (it sits below inference), so the launch layer
builds the judge's engine and hands `open_reward` this factory; `asyncrl train` and `asyncrl
eval` open their reward through `open_run_reward`. The judge engine is separate from the policy's
engine and never receives weight updates: it is a fixed model. It runs on its own thread like
the in-process rollout engine, one KV slot per allowed concurrent judge call, one kernel thread
(it shares the machine with the trainer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from asyncrl.reward.judge import JudgeRewardConfig
from asyncrl.reward.config import open_reward


class EngineJudgeClient:
    """`JudgeClient` over an AsyncLLMEngine: the chat template, greedy at temperature 0."""

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        self.engine, self.tokenizer = engine, tokenizer

    async def complete(self, messages: list[dict[str, str]], cfg: JudgeRewardConfig) -> str:
        from asyncrl.api import GenerationConfig, ModelRequest
        from asyncrl.models.chat import encode_chat_prompt, stop_at_eos

        ids = encode_chat_prompt(self.tokenizer, messages)
        gconfig = stop_at_eos(GenerationConfig(
            max_new_tokens=cfg.max_tokens, greedy=cfg.temperature == 0.0,
            temperature=cfg.temperature or 1.0), self.tokenizer)
        resp = await self.engine.agenerate(ModelRequest(input_ids=ids, gconfig=gconfig))
        return self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)


@contextlib.contextmanager
def engine_judge(cfg: JudgeRewardConfig) -> Iterator[EngineJudgeClient]:
    """The built-in engine on `cfg.model_path`, stopped on exit."""
    from asyncrl.inference.async_engine import AsyncLLMEngine
    from asyncrl.inference.engine import EngineConfig
    from asyncrl.models.loading import load_tokenizer

    tokenizer = load_tokenizer(cfg.model_path)
    engine = AsyncLLMEngine(
        EngineConfig(model_path=str(cfg.model_path), max_num_seqs=cfg.max_concurrency,
                     num_threads=1),
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    try:
        yield EngineJudgeClient(engine, tokenizer)
    finally:
        engine.shutdown()


def open_run_reward(spec: Any) -> contextlib.AbstractContextManager[Any]:
    """`open_reward` with the built-in engine available to a judge (`model_path`)."""
    return open_reward(spec, judge_engine=engine_judge)
