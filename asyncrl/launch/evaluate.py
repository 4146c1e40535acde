"""`asyncrl eval`: held-out greedy accuracy and pass@k of a checkpoint.

`run_eval_job` finds the model in a checkpoint or run directory, starts an in-process engine,
runs `rollout.answer_eval.evaluate` (the evaluation the train loop runs too) with a progress bar
and prints a summary table.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from asyncrl.errors import UserError
from asyncrl.launch.run_checkpoints import find_policy_dir
from asyncrl.launch.judge_engine import open_run_reward
from asyncrl.rollout.answer_eval import DEFAULT_NEW_TOKENS, EvalConfig, EvalResult, evaluate

T = TypeVar("T")

FILE_KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
BUILTIN_DATA = "arithmetic"


# ---- data and rewards ----------------------------------------------------------------------


def load_eval_rows(data: str) -> list[dict[str, Any]]:
    """Every row of a local JSONL / parquet file (question + answer, "#### N" answers split like
    GSM8K), the built-in arithmetic task's held-out split for `data == "arithmetic"`, or the
    held-out rows of an inline dataset mapping (the run config's `data:` forms, e.g.
    '{kind: hf, name: openai/gsm8k, config: main, eval_split: test}')."""
    if data.strip().startswith("{"):
        import yaml

        from asyncrl.data.dataset import parse_dataset_config

        try:
            mapping = yaml.safe_load(data)
        except yaml.YAMLError as err:
            raise UserError(f"--data {data!r}: malformed YAML mapping: {err}") from None
        return parse_dataset_config(mapping, "--data").build().eval_rows()
    if data == BUILTIN_DATA:
        from asyncrl.data.arithmetic import ArithmeticTaskConfig

        return ArithmeticTaskConfig().build().eval_rows()
    kind = FILE_KINDS.get(Path(data).suffix.lower())
    if kind is None:
        raise UserError(f"--data {data}: unknown data; allowed: {BUILTIN_DATA}, a file "
                        f"ending in {', '.join(FILE_KINDS)}, or a dataset mapping "
                        f"('{{kind: hf, name: ..., eval_split: test}}')")
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
                   max_new_tokens: int | None, vision: Any = None) -> tuple[int, int]:
    """(the context the longest problem needs, so the KV cache is no larger than that (a
    vision-language model's prompts with their image tokens); the answers' token limit):
    `max_new_tokens`, or unset DEFAULT_NEW_TOKENS where the model's window has room, else what
    it has. UserError when a given limit does not fit in the window."""
    from asyncrl.inference.model_runner import read_hf_config
    from asyncrl.models.vision import row_prompt

    def length(row: dict[str, Any]) -> int:
        try:
            return len(row_prompt(tokenizer, vision, row)[0])
        except ValueError:  # an undecodable image: evaluate leaves the row out, saying why
            return 0

    lengths = [length(row) for row in rows]
    longest = max(range(len(rows)), key=lengths.__getitem__)
    hf_config = read_hf_config(model_dir)
    window = (hf_config.get("text_config") or hf_config).get("max_position_embeddings")
    new_tokens = max_new_tokens or (DEFAULT_NEW_TOKENS if window is None else max(
        1, min(DEFAULT_NEW_TOKENS, window - lengths[longest])))
    needed = lengths[longest] + new_tokens
    if window is not None and needed > window:
        raise UserError(f"problem {rows[longest].get('id')}: prompt ({lengths[longest]} tokens) "
                        f"+ --max-new-tokens ({new_tokens}) = {needed} exceeds the model's "
                        f"context of {window} tokens")
    return needed, new_tokens


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
                 num_threads: int | None, console: Console,
                 trust_remote_code: bool = False) -> Iterator[Any]:
    """(the engine, its servers' start-up checks): the built-in engine in this process when
    `inference` is None, else the servers it names (the same path `asyncrl train` takes)."""
    from asyncrl.inference.config import EngineSettings
    from asyncrl.launch.launchers import LocalLauncher
    from asyncrl.launch.rollout_engines import open_rollout_engines
    from asyncrl.launch.train_config import InferenceLaunchConfig

    if inference is None:
        inference = InferenceLaunchConfig(mode="inprocess", engine=EngineSettings(
            max_num_seqs=max_num_seqs, max_seq_len=max_seq_len, num_threads=num_threads))
    elif inference.mode == "local":
        console.print(f"eval: generating with {inference.num_servers} local "
                      f"{inference.backend.kind} server(s)", soft_wrap=True)
    else:
        console.print(f"eval: generating with {inference.remote.addresses}", soft_wrap=True)
    with tempfile.TemporaryDirectory(prefix="asyncrl-eval-") as tmp, open_rollout_engines(
            inference.trusting(trust_remote_code), model_dir, Path(tmp) / "logs",
            LocalLauncher()) as engines:
        yield engines.engine, engines.check_servers


def run_to_completion(make: Callable[[], Awaitable[T]]) -> T:
    """`asyncio.run(make())`, also from a thread whose event loop is running (a notebook cell,
    an async caller): there the coroutine runs on a fresh loop in a worker thread, since
    `asyncio.run` refuses to nest. The caller blocks either way (this is a sync API)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncrl-eval") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def run_eval_job(
    model_path: str | Path,
    data: str,
    cfg: EvalConfig,
    reward: str | dict[str, Any] = "exact",
    limit: int | None = None,
    json_out: Path | None = None,
    console: Console | None = None,
    max_num_seqs: int = 64,
    num_threads: int | None = None,
    inference: Any = None,
    trust_remote_code: bool = False,
) -> EvalResult:
    """`asyncrl eval`: every row of `data` (the first `limit`) against the model at `model_path`.

    `inference` (an InferenceLaunchConfig, mode local or remote) evaluates through servers: the
    same backends, launcher and startup checks as `asyncrl train`; None runs the built-in engine
    in this process. Library imports are deferred to here and to `evaluate` so the CLI rejects
    bad flags without spending seconds importing torch and transformers.
    """
    from asyncrl.models.loading import load_tokenizer, resolve_model_path
    from asyncrl.models.vision import vision_encoder

    console = console or Console(stderr=True)
    if limit is not None and limit < 1:
        raise UserError(f"--limit={limit} is out of range; allowed >= 1")
    model_dir = find_policy_dir(resolve_model_path(model_path, setting="checkpoint"))
    rows = load_eval_rows(data)[:limit]
    tokenizer = load_tokenizer(model_dir, trust_remote_code)
    vision = vision_encoder(model_dir, trust_remote_code)
    max_seq_len, new_tokens = _check_lengths(model_dir, tokenizer, rows, cfg.max_new_tokens,
                                             vision)
    cfg = cfg.model_copy(update={"max_new_tokens": new_tokens})
    n = cfg.samples_per_problem
    sampling = f" + {n} samples at T={cfg.temperature}" if n else ""
    console.print(f"eval: model {model_dir}", soft_wrap=True)  # paths stay greppable: no wrap
    console.print(f"eval: {len(rows)} problems from {data}; greedy{sampling}", soft_wrap=True)
    with contextlib.ExitStack() as stack:
        engine, startup = stack.enter_context(_eval_engine(
            model_dir, inference, max_num_seqs, max_seq_len, num_threads, console,
            trust_remote_code))
        reward_fn = stack.enter_context(open_run_reward(reward))
        with Progress(
            TextColumn("[bold]eval"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console,
        ) as progress:
            task = progress.add_task("eval", total=len(rows))
            async def checked_eval() -> EvalResult:
                await startup()  # server checks on the loop the evaluation uses
                return await evaluate(
                    engine, tokenizer, rows, reward_fn, cfg,
                    on_progress=lambda done, total: progress.update(task, completed=done),
                    vision=vision)

            result = run_to_completion(checked_eval)
    print_summary(console, result, "eval summary")
    if json_out is not None:
        payload = {"model": str(model_dir), "data": data, "reward": reward,
                   "config": cfg.to_dict(), **result.to_dict()}
        json_out = Path(json_out)
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(payload, indent=1) + "\n")
        console.print(f"wrote {len(result.records)} problem records to {json_out}", soft_wrap=True)
    return result
