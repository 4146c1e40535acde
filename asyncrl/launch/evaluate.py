"""Held-out evaluation: greedy accuracy and unbiased pass@k of a policy behind any InferenceEngine.

`evaluate` is the library call (the train loop runs it every `EvalConfig.every` steps on the engine
it already has); `run_eval_job` is `asyncrl eval`: it finds the model in a checkpoint or run
directory, starts an in-process engine, shows a progress bar and prints a summary table.

A sample is *correct* when its reward exceeds CORRECT_THRESHOLD (0.5): binary verifiers return
0.0 / 1.0, and a shaped reward counts as a pass only when it is closer to success than to failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pydantic
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from asyncrl.api import GenerationConfig, InferenceEngine, ModelRequest
from asyncrl.config import Config
from asyncrl.errors import UserError
from asyncrl.launch.rewards import open_reward
from asyncrl.rollout.reward_call import RewardFn, call_reward

CORRECT_THRESHOLD = 0.5
STEP_DIR = re.compile(r"step_(\d+)")
LATEST_FILE = "latest"
FILE_KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
BUILTIN_DATA = "arithmetic"


class EvalConfig(Config):
    every: int = pydantic.Field(10, ge=0, description="training steps between evals; 0 = off")
    size: int = pydantic.Field(256, ge=1, description="held-out problems the train loop scores")
    pass_k: list[int] = pydantic.Field(default_factory=list,
                                       description="k values of pass@k; empty = greedy only")
    num_samples: int | None = pydantic.Field(
        None, ge=1, description="samples per problem for pass@k; None = max(pass_k)")
    temperature: float = pydantic.Field(1.0, gt=0, description="sampling temperature for pass@k")
    max_new_tokens: int = pydantic.Field(16, ge=1)
    seed: int = pydantic.Field(0, ge=0, description="base of the per-sample seeds")
    concurrency: int = pydantic.Field(256, ge=1, description="requests in flight at once")

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

    def summary(self) -> dict[str, float]:
        out = {"eval/greedy_accuracy": self.greedy_accuracy}
        out.update({f"eval/pass@{k}": v for k, v in sorted(self.pass_at_k.items())})
        if self.mean_sample_reward is not None:
            out["eval/mean_sample_reward"] = self.mean_sample_reward
        out["eval/num_problems"] = float(self.num_problems)
        out["eval/seconds"] = self.seconds
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "problems": [asdict(r) for r in self.records]}


def _sample_seed(base: int, problem: int, sample: int, n: int) -> int:
    return base + problem * n + sample  # distinct for every (problem, sample) of one eval


async def evaluate(
    engine: InferenceEngine,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    reward_fn: RewardFn,
    cfg: EvalConfig,
    on_progress: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Score every row in `rows` (callers pick the subset, e.g. `eval_rows()[:cfg.size]`).

    Per problem: one greedy completion and `cfg.samples_per_problem` sampled ones, each its own
    request. At most `cfg.concurrency` requests are in flight, run by that many worker coroutines
    pulling from one job stream, so 10k problems never become 80k pending coroutines.
    `on_progress(done, total)` is called each time a problem's last request finishes.
    """
    from asyncrl.models.chat import encode_chat_prompt  # asyncrl.models pulls in torch

    if not rows:
        raise ValueError("evaluate: rows is empty; need at least one problem")
    start = time.perf_counter()
    n = cfg.samples_per_problem
    prompts = [encode_chat_prompt(tokenizer, row["messages"]) for row in rows]
    stop = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    greedy = GenerationConfig(greedy=True, max_new_tokens=cfg.max_new_tokens, stop_token_ids=stop)
    sampled = GenerationConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                               stop_token_ids=stop)
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
                                                       metadata={"eval_id": row_id}))
        except ValueError as err:  # the engine refused this prompt (too long, bad ids)
            raise ValueError(f"eval problem {row_id}: {err}") from err
        text = tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        reward = await call_reward(reward_fn, text, rows[i])
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
    return _result(rows, greedy_text, greedy_reward, sample_rewards, cfg,
                   time.perf_counter() - start)


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


# ---- finding the model ---------------------------------------------------------------------


def _is_model_dir(p: Path) -> bool:
    return (p / "config.json").is_file()


def _latest_step_dir(checkpoints: Path) -> Path | None:
    """The step directory `checkpoints/latest` names, else the highest `step_NNNNNN`."""
    latest = checkpoints / LATEST_FILE
    if latest.is_file():
        name = latest.read_text().strip()
        target = checkpoints / name  # an absolute path in the file stays absolute
        if not name or not target.is_dir():
            raise UserError(f"{latest} names {name!r}, which is not a directory under "
                            f"{checkpoints}")
        return target
    steps = [(int(m.group(1)), d) for d in checkpoints.iterdir()
             if d.is_dir() and (m := STEP_DIR.fullmatch(d.name))]
    return max(steps)[1] if steps else None


def resolve_model_dir(path: str | Path) -> Path:
    """The HF model directory inside `path`: `path` itself (config.json), a training checkpoint's
    `policy/`, or a run directory's latest `checkpoints/step_NNNNNN/policy/`."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"checkpoint {p} not found; expected a HF model dir, a checkpoint dir "
                        "(policy/) or a run dir (checkpoints/step_NNNNNN/)")
    if _is_model_dir(p):
        return p
    if _is_model_dir(p / "policy"):
        return p / "policy"
    checkpoints = p / "checkpoints"
    if checkpoints.is_dir():
        step = _latest_step_dir(checkpoints)
        if step is not None:
            if _is_model_dir(step / "policy"):
                return step / "policy"
            raise UserError(f"checkpoint {step} has no policy/config.json; expected the HF "
                            "model directory the train loop writes there")
    raise UserError(f"{p} is not a model or checkpoint: looked for {p}/config.json (HF model "
                    f"dir), {p}/policy/config.json (checkpoint) and {p}/checkpoints/"
                    "step_NNNNNN/policy/config.json (run dir)")


# ---- data and rewards ----------------------------------------------------------------------


def load_eval_rows(data: str) -> list[dict[str, Any]]:
    """Every row of a local JSONL / parquet file (question + answer, "#### N" answers split like
    GSM8K), or the built-in arithmetic task's held-out split for `data == "arithmetic"`."""
    if data == BUILTIN_DATA:
        from asyncrl.data.arithmetic import ArithmeticTaskConfig

        return ArithmeticTaskConfig().build().eval_rows()
    kind = FILE_KINDS.get(Path(data).suffix.lower())
    if kind is None:
        raise UserError(f"--data {data}: unknown data; allowed: {BUILTIN_DATA}, or a file "
                        f"ending in {', '.join(FILE_KINDS)}")
    from asyncrl.data.files import FileDatasetConfig, read_rows

    return read_rows(data, FileDatasetConfig(kind=kind, path=data))


def parse_k_list(text: str, flag: str = "--k") -> list[int]:
    """"1,4,8" -> [1, 4, 8]; anything else is a one-line UserError naming the flag."""
    try:
        ks = [int(part) for part in text.split(",")]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise UserError(f"{flag}={text!r}: expected comma-separated integers >= 1, e.g. 1,4,8")
    return ks


# ---- the job -------------------------------------------------------------------------------


def _check_lengths(model_dir: Path, tokenizer: Any, rows: list[dict[str, Any]],
                   max_new_tokens: int) -> int:
    """The context the longest problem needs (so the KV cache is no larger than that); UserError
    when it exceeds the model's window."""
    from asyncrl.inference.model_runner import read_hf_config
    from asyncrl.models.chat import encode_chat_prompt

    lengths = [len(encode_chat_prompt(tokenizer, row["messages"])) for row in rows]
    longest = max(range(len(rows)), key=lengths.__getitem__)
    needed = lengths[longest] + max_new_tokens
    window = read_hf_config(model_dir).get("max_position_embeddings", needed)
    if needed > window:
        raise UserError(f"problem {rows[longest].get('id')}: prompt ({lengths[longest]} tokens) "
                        f"+ --max-new-tokens ({max_new_tokens}) = {needed} exceeds the model's "
                        f"context of {window} tokens")
    return needed


def print_summary(console: Console, result: EvalResult, title: str) -> None:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("problems", str(result.num_problems))
    table.add_row("greedy accuracy", f"{result.greedy_accuracy:.2%}")
    for k, value in sorted(result.pass_at_k.items()):
        table.add_row(f"pass@{k}", f"{value:.2%}")
    if result.mean_sample_reward is not None:
        table.add_row("mean sample reward", f"{result.mean_sample_reward:.4f}")
    table.add_row("seconds", f"{result.seconds:.2f}")
    table.add_row("problems/s", f"{result.num_problems / max(result.seconds, 1e-9):.2f}")
    console.print(table)


@contextlib.contextmanager
def _eval_engine(model_dir: Path, inference: Any, max_num_seqs: int, max_seq_len: int,
                 num_threads: int | None, console: Console) -> Iterator[Any]:
    if inference is None:
        from asyncrl.inference.async_engine import AsyncLLMEngine
        from asyncrl.inference.engine import EngineConfig

        engine = AsyncLLMEngine(EngineConfig(model_path=str(model_dir), max_num_seqs=max_num_seqs,
                                             max_seq_len=max_seq_len, num_threads=num_threads))
        try:
            yield engine, None
        finally:
            engine.shutdown()
        return
    from asyncrl.launch.rollout_engines import open_rollout_engines

    with tempfile.TemporaryDirectory(prefix="asyncrl-eval-") as tmp:
        where = (f"{inference.num_servers} local {inference.server_backend} server(s)"
                 if inference.mode == "local" else f"{inference.remote.addresses}")
        console.print(f"eval: generating with {where}", soft_wrap=True)
        with open_rollout_engines(inference, model_dir, Path(tmp) / "logs") as engines:
            yield engines.engine, partial(engines.start_checks, 0)


def run_eval_job(
    model_path: str | Path,
    data: str,
    cfg: EvalConfig,
    reward: str = "exact",
    limit: int | None = None,
    json_out: Path | None = None,
    console: Console | None = None,
    max_num_seqs: int = 64,
    num_threads: int | None = None,
    inference: Any = None,
) -> EvalResult:
    """`asyncrl eval`: every row of `data` (the first `limit`) against the model at `model_path`.

    `inference` (an InferenceLaunchConfig, mode local or remote) evaluates through servers: the
    same backends, launcher and startup checks as `asyncrl train`; None runs the built-in engine
    in this process. Library imports are deferred to here and to `evaluate` so the CLI rejects
    bad flags without spending seconds importing torch and transformers.
    """
    from asyncrl.models.loading import load_tokenizer

    console = console or Console(stderr=True)
    if limit is not None and limit < 1:
        raise UserError(f"--limit={limit} is out of range; allowed >= 1")
    model_dir = resolve_model_dir(model_path)
    rows = load_eval_rows(data)[:limit]
    tokenizer = load_tokenizer(model_dir)
    max_seq_len = _check_lengths(model_dir, tokenizer, rows, cfg.max_new_tokens)
    n = cfg.samples_per_problem
    sampling = f" + {n} samples at T={cfg.temperature}" if n else ""
    console.print(f"eval: model {model_dir}", soft_wrap=True)  # paths stay greppable: no wrap
    console.print(f"eval: {len(rows)} problems from {data}; greedy{sampling}", soft_wrap=True)
    with contextlib.ExitStack() as stack:
        engine, startup = stack.enter_context(_eval_engine(model_dir, inference, max_num_seqs,
                                                           max_seq_len, num_threads, console))
        reward_fn = stack.enter_context(open_reward(reward))
        with Progress(
            TextColumn("[bold]eval"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console,
        ) as progress:
            task = progress.add_task("eval", total=len(rows))
            async def checked_eval() -> EvalResult:
                if startup is not None:  # server checks on the loop the evaluation uses
                    await startup()
                return await evaluate(
                    engine, tokenizer, rows, reward_fn, cfg,
                    on_progress=lambda done, total: progress.update(task, completed=done))

            result = asyncio.run(checked_eval())
    print_summary(console, result, "eval summary")
    if json_out is not None:
        payload = {"model": str(model_dir), "data": data, "reward": reward,
                   "config": cfg.to_dict(), **result.to_dict()}
        json_out = Path(json_out)
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(payload, indent=1) + "\n")
        console.print(f"wrote {len(result.records)} problem records to {json_out}", soft_wrap=True)
    return result
