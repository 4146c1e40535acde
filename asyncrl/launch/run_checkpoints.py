"""Checkpoints of a training run: RUN/checkpoints/step_NNNNNN/{state/, policy/, [adapter/,]
state.json}, and `RunCheckpointer`, the one place a run's stateful parts are registered.

Every stateful part of a run saves and loads through its `state_dict` / `load_state_dict`: the
policy engine (`trainer`) and the critic (`critic`) as sharded parts (every rank writes its own
shards; any number of ranks resumes them), the loop's counters (`loop`), the data stream's
position (`data`) and the rollout executor (`rollout`: its staleness counters and the episodes
in flight, suspended for the checkpoint: rows queued, trajectories not consumed, generations cut
mid-way with their tokens) as plain parts of rank 0. They all go to `state/` in one
train/checkpoint.py `save_state`; a resume builds the same parts and loads them in one
`load_state`. `policy/` is an export, not state: a plain HF model directory written by
save_pretrained (config, generation config, safetensors sharded by `checkpoint_shard_size` with
an index, tokenizer and chat template) that transformers, `asyncrl eval`, `asyncrl serve` or
vLLM load directly (with `train.lora` the adapter merged in; `adapter/` holds the adapter alone,
as `PeftModel.save_pretrained` writes it). `state.json` says what the checkpoint holds, for a
reader; it is written last, so a directory without it is incomplete. A checkpoint is written
under a hidden name and renamed into place, then `latest` is updated, so a crash mid-write never
leaves a checkpoint that looks complete.

This module owns that layout: saving and resuming (`latest_checkpoint`) as well as finding the
policy that `asyncrl eval` loads (`find_policy_dir`) go through the names below.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl.api import Stateful
from asyncrl.errors import UserError
from asyncrl.models.config import DEFAULT_SHARD_SIZE
from asyncrl.train.checkpoint import load_state, save_state
from asyncrl.train.parallel import Parallelism

CHECKPOINTS = "checkpoints"
LATEST = "latest"  # a file in CHECKPOINTS holding the newest step directory's name
STATE_DIR = "state"  # every part's state (train/checkpoint.py)
POLICY = "policy"
ADAPTER = "adapter"  # train.lora: the LoRA adapter (PEFT format); policy/ holds it merged
SUMMARY = "state.json"
STEP_NAME = re.compile(r"step_(\d+)")


@dataclass
class LoopState:
    """The loop's own counters (a plain part of every checkpoint)."""

    step: int = 0
    train_seconds: float = 0.0  # training wall time so far (evals and checkpoints excluded)
    wall_seconds: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.train_seconds = state["step"], state["train_seconds"]
        self.wall_seconds = state["wall_seconds"]


@dataclass(frozen=True)
class PolicyExport:
    """What `policy/` is written from: the policy engine (its full weights are gathered), the
    tokenizer, the largest safetensors file, and the base model directory whose processor files
    (a vision-language model's image processor) are copied along."""

    engine: Any  # train.engine.HFTrainEngine
    tokenizer: Any
    shard_size: int | str = DEFAULT_SHARD_SIZE
    base: Path | None = None


class RunCheckpointer:
    """A run's stateful parts, registered once; every rank of a torchrun group has one (with the
    same sharded parts; the plain ones are rank 0's) and calls `save` / `load` together."""

    def __init__(self, run_dir: Path, parallel: Parallelism, sharded: Mapping[str, Stateful],
                 plain: Mapping[str, Stateful] | None = None,
                 export: PolicyExport | None = None, keep: int = 3) -> None:
        self.run_dir, self.parallel = Path(run_dir), parallel
        self.sharded, self.plain = dict(sharded), dict(plain or {})
        self.export, self.keep = export, keep

    def save(self, step: int) -> Path:
        """Write checkpoint `step` (every rank calls); its directory."""
        final = step_dir(self.run_dir, step)
        tmp = final.parent / f".{final.name}.tmp"
        writer = self.parallel.rank == 0
        if writer and tmp.exists():
            shutil.rmtree(tmp)
        if self.export is not None:
            self._export(tmp)
        save_state(tmp / STATE_DIR, self.parallel, self.sharded, self.plain)
        if not writer:
            return final
        summary = {name: part.state_dict() for name, part in self.plain.items()}
        (tmp / SUMMARY).write_text(json.dumps(summary, indent=2, default=repr))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest = final.parent / LATEST
        latest.with_suffix(".tmp").write_text(final.name)
        os.replace(latest.with_suffix(".tmp"), latest)
        _prune(final.parent, self.keep)
        return final

    def load(self, ckpt: Path) -> None:
        """Restore every registered part from checkpoint directory `ckpt` (every rank calls)."""
        load_state(ckpt / STATE_DIR, self.parallel, self.sharded, self.plain)

    def _export(self, tmp: Path) -> None:
        """policy/ (and adapter/ with LoRA): gathered on every rank, written by rank 0."""
        from asyncrl.models.export import save_weights_dir

        engine, writer = self.export.engine, self.parallel.rank == 0
        weights = engine.model_state_dict()  # full on rank 0 (collective under FSDP)
        if writer:
            save_weights_dir(weights, engine.model.config, tmp / POLICY, self.export.tokenizer,
                             generation_config=getattr(engine.model, "generation_config", None),
                             max_shard_size=self.export.shard_size,
                             processor_from=self.export.base)
        del weights  # under FSDP rank 0's gathered copy: gone before the state is saved
        if engine.lora is not None:  # the adapter, PEFT's layout
            from asyncrl.models.lora import write_adapter_dir
            from asyncrl.train.lora import peft_config_dict

            adapter = engine.adapter_state_dict()  # collective under FSDP (per matrix)
            if writer:
                write_adapter_dir(adapter, peft_config_dict(engine.model), tmp / ADAPTER)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step_{step:06d}"


def step_dirs(checkpoints: Path) -> list[Path]:
    """The step_NNNNNN directories under `checkpoints`, oldest first; half-written saves
    (`.step_NNNNNN.tmp`) are not among them."""
    if not checkpoints.is_dir():
        return []
    steps = [(int(m.group(1)), d) for d in checkpoints.iterdir()
             if d.is_dir() and (m := STEP_NAME.fullmatch(d.name))]
    return [d for _, d in sorted(steps)]


def _prune(checkpoints: Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in step_dirs(checkpoints)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path:
    """The checkpoint `--resume` continues from: the one `latest` names, else the newest complete
    one (a resume should go on from what is there rather than stop at a stale `latest`)."""
    checkpoints = run_dir / CHECKPOINTS
    marker = checkpoints / LATEST
    name = marker.read_text().strip() if marker.is_file() else ""
    named = [checkpoints / name] if name else []
    for path in [*named, *reversed(step_dirs(checkpoints))]:
        if (path / SUMMARY).is_file():
            return path
    raise UserError(f"no checkpoint found under {checkpoints} (expected step_NNNNNN/ "
                    f"directories with {SUMMARY}, as asyncrl train writes them)")


def _is_model_dir(p: Path) -> bool:
    return (p / "config.json").is_file()


def find_policy_dir(path: str | Path) -> Path:
    """The HF model directory inside `path`: `path` itself (config.json), a training checkpoint's
    `policy/`, or the `policy/` of the checkpoint a resume of run directory `path` would take."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"checkpoint {p} not found; expected a HF model dir, a checkpoint dir "
                        "(policy/) or a run dir (checkpoints/step_NNNNNN/)")
    if _is_model_dir(p):
        return p
    if _is_model_dir(p / POLICY):
        return p / POLICY
    if (p / CHECKPOINTS).is_dir():
        step = latest_checkpoint(p)
        if _is_model_dir(step / POLICY):
            return step / POLICY
        raise UserError(f"checkpoint {step} has no policy/config.json; expected the HF "
                        "model directory the train loop writes there")
    raise UserError(f"{p} is not a model or checkpoint: looked for {p}/config.json (HF model "
                    f"dir), {p}/policy/config.json (checkpoint) and {p}/checkpoints/"
                    "step_NNNNNN/policy/config.json (run dir)")
