"""Answer accuracy of a policy on held-out rows: greedy accuracy and unbiased pass@k.

The evaluation of the reward-driven workflows (RLVR, multi-turn): they return it from their
`aevaluate`, so the trainer runs it every `EvalConfig.every` steps on the engine it already has;
`asyncrl eval` (launch/evaluate.py) runs the same `evaluate` on a checkpoint.

A sample is *correct* when its reward exceeds CORRECT_THRESHOLD (0.5): binary verifiers return
0.0 / 1.0, and a shaped reward counts as a pass only when it is closer to success than to failure.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import pydantic

from asyncrl.api import EvalReport, GenerationConfig, InferenceEngine, ModelRequest
from asyncrl.config import Config
from asyncrl.reward.call import RewardFn, call_reward

if TYPE_CHECKING:
    from asyncrl.models.chat_options import ChatOptions

CORRECT_THRESHOLD = 0.5


DEFAULT_NEW_TOKENS = 1024  # an eval answer's limit outside a training job (`asyncrl eval`)


class EvalConfig(Config):
    every: int = pydantic.Field(10, ge=0, description="training steps between evals; 0 = off")
    # training seconds between evals, checked after each step (with `every`, whichever comes
    # first): equal time resolution for runs whose steps take different times; None: steps only
    every_s: float | None = pydantic.Field(None, gt=0)
    # in a training job: suspend the training episodes in flight while an evaluation runs (as a
    # checkpoint does: generations keep their tokens; an episode waiting on something else, a
    # tool call, is restarted from its row), so the evaluation's time, which the training clock
    # leaves out, gives the rollouts no progress either (timing studies: benchmarks/bench_async.py)
    pause_rollouts: bool = False
    size: int = pydantic.Field(256, ge=1, description="held-out problems the train loop scores")
    pass_k: list[int] = pydantic.Field(default_factory=list,
                                       description="k values of pass@k; empty = greedy only")
    num_samples: int | None = pydantic.Field(
        None, ge=1, description="samples per problem for pass@k; None = max(pass_k)")
    temperature: float = pydantic.Field(1.0, gt=0, description="sampling temperature for pass@k")
    # generation limit of an eval answer; None: a training job's gconfig.max_new_tokens
    # (TrainRunConfig.evaluation), else DEFAULT_NEW_TOKENS
    max_new_tokens: int | None = pydantic.Field(None, ge=1)
    seed: int = pydantic.Field(0, ge=0, description="base of the per-sample seeds")
    concurrency: int = pydantic.Field(256, ge=1, description="requests in flight at once")

    @property
    def enabled(self) -> bool:
        return bool(self.every) or self.every_s is not None

    @pydantic.field_validator("pass_k")
    @classmethod
    def _positive_ks(cls, ks: list[int]) -> list[int]:
        bad = [k for k in ks if k < 1]
        if bad:
            raise ValueError(f"pass_k={ks}: each k must be >= 1, got {bad}")
        return sorted(set(ks))

    @pydantic.model_validator(mode="after")
    def _enough_samples(self) -> EvalConfig:
        if self.num_samples is not None and self.pass_k and self.num_samples < max(self.pass_k):
            raise ValueError(f"num_samples={self.num_samples} is smaller than max(pass_k)="
                             f"{max(self.pass_k)}; pass@k needs at least k samples per problem")
        return self

    @property
    def new_tokens(self) -> int:
        """max_new_tokens, DEFAULT_NEW_TOKENS when unset."""
        return self.max_new_tokens or DEFAULT_NEW_TOKENS

    @property
    def samples_per_problem(self) -> int:
        """Sampled completions per problem (besides the greedy one); 0 when pass_k is empty and
        num_samples unset."""
        return self.num_samples if self.num_samples is not None else max(self.pass_k, default=0)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Chen et al. 2021 (Codex), in product form: C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i),
    which never forms the huge binomials.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if value < 0:
            raise ValueError(f"pass_at_k: {name}={value} is out of range; allowed >= 0")
    if k < 1:
        raise ValueError(f"pass_at_k: k={k} is out of range; allowed [1, n={n}]")
    if c > n:
        raise ValueError(f"pass_at_k: c={c} is out of range; allowed [0, n={n}]")
    if k > n:
        raise ValueError(f"pass_at_k: k={k} is out of range; allowed [1, n={n}]")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass
class ProblemRecord:
    id: str
    question: str
    answer: str
    greedy_completion: str
    greedy_reward: float
    num_correct: int  # correct samples out of num_samples
    num_samples: int


@dataclass
class EvalResult:
    greedy_accuracy: float
    pass_at_k: dict[int, float]
    num_problems: int
    seconds: float
    mean_sample_reward: float | None  # None when no samples were drawn
    records: list[ProblemRecord] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # rows left out (an undecodable image), why

    def summary(self) -> dict[str, float]:
        out = {"eval/greedy_accuracy": self.greedy_accuracy}
        out.update({f"eval/pass@{k}": v for k, v in sorted(self.pass_at_k.items())})
        if self.mean_sample_reward is not None:
            out["eval/mean_sample_reward"] = self.mean_sample_reward
        out["eval/num_problems"] = float(self.num_problems)
        if self.skipped:
            out["eval/skipped_problems"] = float(len(self.skipped))
        out["eval/seconds"] = self.seconds
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "problems": [asdict(r) for r in self.records]}

    def report(self) -> EvalReport:
        detail = "".join(f", pass@{k} {v:.1%}" for k, v in self.pass_at_k.items())
        if self.skipped:
            detail += f"; {len(self.skipped)} rows skipped, e.g. {self.skipped[0]}"
        answers = {r.id: (r.greedy_completion, r.greedy_reward) for r in self.records}
        return EvalReport(self.greedy_accuracy, "greedy accuracy", self.summary(), detail,
                          answers)


def _sample_seed(base: int, problem: int, sample: int, n: int) -> int:
    return base + problem * n + sample  # distinct for every (problem, sample) of one eval


async def evaluate(
    engine: InferenceEngine, tokenizer: Any, rows: Sequence[dict[str, Any]], reward_fn: RewardFn,
    cfg: EvalConfig, on_progress: Callable[[int, int], None] | None = None,
    chat: ChatOptions | None = None, reward_sees_reasoning: bool = False, vision: Any = None,
) -> EvalResult:
    """Score every row in `rows` (callers pick the subset, e.g. `eval_rows()[:cfg.size]`).

    Per problem: one greedy completion and `cfg.samples_per_problem` sampled ones, each its own
    request. At most `cfg.concurrency` requests are in flight, run by that many worker coroutines
    pulling from one job stream, so 10k problems never become 80k pending coroutines.
    `on_progress(done, total)` is called each time a problem's last request finishes.
    `chat` (the model's ChatOptions): template variables for the prompts and, with a reasoning
    parser, the answer after the reasoning is what the reward reads (as in training).
    `vision`: a vision-language model's VisionPromptEncoder (rows with images).
    """
    from asyncrl.models.chat import stop_at_eos  # asyncrl.models: torch
    from asyncrl.models.chat_options import ChatOptions
    chat = chat or ChatOptions()
    kwargs = chat.template_kwargs()

    if not rows:
        raise ValueError("evaluate: rows is empty; need at least one problem")
    start = time.perf_counter()
    n = cfg.samples_per_problem
    rows, prompts, images, skipped = _prompts(tokenizer, vision, rows, kwargs)
    greedy = stop_at_eos(GenerationConfig(greedy=True, max_new_tokens=cfg.new_tokens),
                         tokenizer)
    sampled = stop_at_eos(GenerationConfig(temperature=cfg.temperature,
                                           max_new_tokens=cfg.new_tokens), tokenizer)
    greedy_text = [""] * len(rows)
    greedy_reward = [0.0] * len(rows)
    sample_rewards: list[list[float]] = [[] for _ in rows]
    remaining = [1 + n] * len(rows)
    done = 0

    async def run(i: int, j: int) -> None:  # j = -1 is the greedy request
        gconfig = greedy if j < 0 else sampled.replace(seed=_sample_seed(cfg.seed, i, j, n))
        row_id = rows[i].get("id", i)
        try:
            resp = await engine.agenerate(ModelRequest(prompts[i], gconfig,
                                                       metadata={"eval_id": row_id},
                                                       images=images[i]))
        except ValueError as err:  # the engine refused this prompt (too long, bad ids)
            raise ValueError(f"eval problem {row_id}: {err}") from err
        text = tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        answer = chat.reward_text(text, reward_sees_reasoning, kwargs)
        reward = await call_reward(reward_fn, answer, rows[i])
        if j < 0:
            greedy_text[i], greedy_reward[i] = text, reward
        else:
            sample_rewards[i].append(reward)

    jobs = ((i, j) for i in range(len(rows)) for j in range(-1, n))  # problem-major

    async def worker() -> None:
        nonlocal done
        for i, j in jobs:  # next() never awaits, so workers share the generator safely
            await run(i, j)
            remaining[i] -= 1
            if remaining[i] == 0:
                done += 1
                if on_progress is not None:
                    on_progress(done, len(rows))

    tasks = [asyncio.create_task(worker())
             for _ in range(min(cfg.concurrency, len(rows) * (1 + n)))]
    try:
        await asyncio.gather(*tasks)  # the first error propagates as itself (no ExceptionGroup)
    finally:  # on an error or cancellation, stop the other workers and so their requests
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    result = _result(rows, greedy_text, greedy_reward, sample_rewards, cfg,
                     time.perf_counter() - start)
    result.skipped = skipped
    return result


def _prompts(tokenizer: Any, vision: Any, rows: Sequence[dict[str, Any]],
             kwargs: dict[str, Any]) -> tuple[list[dict[str, Any]], list, list, list[str]]:
    """(the rows whose prompt could be built, their prompts, their images, why each other row was
    left out): a row whose image cannot be decoded is skipped with its reason, not fatal."""
    from asyncrl.models.vision import row_prompt

    kept, prompts, images, skipped = [], [], [], []
    for i, row in enumerate(rows):
        try:
            ids, pictures = row_prompt(tokenizer, vision, row, kwargs)
        except ValueError as err:
            skipped.append(f"eval problem {row.get('id', i)}: {err}")
            continue
        kept.append(row)
        prompts.append(ids)
        images.append(pictures)
    if not kept:
        raise ValueError(f"evaluate: no row has a usable prompt; first: {skipped[0]}")
    return kept, prompts, images, skipped


def _result(rows, greedy_text, greedy_reward, sample_rewards, cfg: EvalConfig,
            seconds: float) -> EvalResult:
    n = cfg.samples_per_problem
    correct = [sum(r > CORRECT_THRESHOLD for r in rs) for rs in sample_rewards]
    records = [
        ProblemRecord(str(row.get("id", i)), str(row.get("question", "")),
                      str(row.get("answer", "")), greedy_text[i], greedy_reward[i], correct[i], n)
        for i, row in enumerate(rows)
    ]
    num = len(rows)
    all_samples = [r for rs in sample_rewards for r in rs]
    return EvalResult(
        greedy_accuracy=sum(r > CORRECT_THRESHOLD for r in greedy_reward) / num,
        pass_at_k={k: sum(pass_at_k(n, c, k) for c in correct) / num for k in cfg.pass_k},
        num_problems=num,
        seconds=seconds,
        mean_sample_reward=sum(all_samples) / len(all_samples) if all_samples else None,
        records=records,
    )
