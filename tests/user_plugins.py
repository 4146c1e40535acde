"""A researcher's own workflow and loss, written only against `asyncrl`'s public API (nothing
from inside the package): tests/test_trainer_api.py hands them to the trainer as objects and as
dotted paths."""

from __future__ import annotations

import asyncio

import torch

from asyncrl import (EvalReport, GenerationConfig, LossInputs, ModelRequest, Sample,
                     Trajectory)


class OddFirstTokenWorkflow:
    """A group of `n` answers per row; reward 1 when the first sampled token id is odd (on a
    random model that varies, so every group has a gradient)."""

    def __init__(self, tokenizer, n: int = 4, max_new_tokens: int = 6) -> None:
        self.tokenizer, self.n = tokenizer, n
        self.gconfig = GenerationConfig(max_new_tokens=max_new_tokens)
        self.episodes = 0

    async def arun_episode(self, engine, data) -> Trajectory:
        prompt = self.tokenizer.encode(data["question"])
        responses = await asyncio.gather(*(
            engine.agenerate(ModelRequest(input_ids=prompt, gconfig=self.gconfig))
            for _ in range(self.n)))
        self.episodes += 1
        samples = [Sample.from_prompt_and_completion(
            prompt, r.output_tokens, r.output_logprobs, r.output_versions,
            reward=float(r.output_tokens[0] % 2), stop_reason=r.stop_reason) for r in responses]
        return Trajectory(samples, group_id=str(data.get("id", "")))

    def metrics(self) -> dict[str, float]:
        return {"user/episodes": float(self.episodes)}


def make_workflow(tokenizer, n: int = 4):
    """A factory, as a YAML `workflow: {path: user_plugins:make_workflow, kwargs: {n: 2}}` names
    it; the workflow config injects `tokenizer` because the signature asks for it."""
    return OddFirstTokenWorkflow(tokenizer, n=n)


class GreedyOddEval:
    """An evaluation of one's own: the share of rows whose greedy first token is odd."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    async def aevaluate(self, engine, rows) -> EvalReport:
        g = GenerationConfig(max_new_tokens=1, greedy=True)
        outs = await asyncio.gather(*(engine.agenerate(
            ModelRequest(input_ids=self.tokenizer.encode(r["question"]), gconfig=g))
            for r in rows))
        score = sum(o.output_tokens[0] % 2 for o in outs) / len(rows)
        return EvalReport(score, "odd share", {"eval/odd_share": score})


class ScaledReinforce:
    """A user loss: -scale * A * log p on the trained tokens (no ratio, no clip)."""

    calls = 0
    normalize_by = "tokens"  # the normaliser counts the step's trained tokens
    needs_entropy = False

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, logprobs: torch.Tensor, inputs: LossInputs, normalizer: torch.Tensor):
        for name in ("loss_mask", "advantages", "behaviour_logprobs", "proximal_logprobs"):
            if not isinstance(getattr(inputs, name), torch.Tensor):
                raise TypeError(f"inputs.{name} is not a tensor")
        ScaledReinforce.calls += 1
        mask = inputs.loss_mask
        loss = -(self.scale * inputs.advantages * logprobs * mask).sum() / normalizer
        return loss, {"user/loss_calls": 1.0, "user/mean_adv": float(inputs.advantages[mask].abs().mean())}
