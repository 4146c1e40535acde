"""Checkpoints of a training run: RUN/checkpoints/step_NNNNNN/{policy/, trainer/, [critic/,]
state.json, rollouts.pkl}.

`policy/` is a plain HF model directory written by save_pretrained (config, generation config,
safetensors sharded by `checkpoint_shard_size` with an index, tokenizer and chat template) that
transformers, `asyncrl eval`, `asyncrl serve` or vLLM load directly (with `train.lora` the
adapter merged in; `adapter/` holds the adapter alone, as `PeftModel.save_pretrained` writes
it); `trainer/` holds the full training state (weights and optimizer sharded by rank,
resumable on another world size; LR schedule, RNG, the policy version); `state.json` the loop's
own position (step, data position, elapsed time) and the rollout side's staleness counters;
`rollouts.pkl` the episodes in flight (rows queued, trajectories not consumed, suspended
generations: rollout/snapshot.py). A checkpoint is written under a hidden name and
renamed into place, then `latest` is updated, so a crash mid-write never leaves a checkpoint that
looks complete.

This module owns that layout: saving and resuming (`latest_checkpoint`) as well as finding the
policy that `asyncrl eval` loads (`find_policy_dir`) go through the names below.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.errors import UserError
from asyncrl.models.config import DEFAULT_SHARD_SIZE

CHECKPOINTS = "checkpoints"
LATEST = "latest"  # a file in CHECKPOINTS holding the newest step directory's name
POLICY = "policy"
TRAINER = "trainer"  # the policy engine's full state (train/checkpoint.py)
CRITIC = "critic"  # the critic engine's, when the run has one
ADAPTER = "adapter"  # train.lora: the LoRA adapter (PEFT format); policy/ holds it merged
STATE = "state.json"
ROLLOUTS = "rollouts.pkl"  # the executor's snapshot of the episodes in flight
STEP_NAME = re.compile(r"step_(\d+)")


@dataclass
class LoopState:
    step: int
    data_position: int
    train_seconds: float  # training wall time so far (evals and checkpoints excluded)
    wall_seconds: float
    rollout: dict[str, Any] = field(default_factory=dict)  # WorkflowExecutor.state_dict()
    in_flight: dict[str, int] = field(default_factory=dict)  # RolloutSnapshot.counts()


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


def read_latest(checkpoints: Path) -> str | None:
    """The name the `latest` file holds ("" when empty), or None when there is no such file."""
    marker = checkpoints / LATEST
    return marker.read_text().strip() if marker.is_file() else None


def save_run_checkpoint(run_dir: Path, state: LoopState, trainer: Any, tokenizer: Any,
                        keep: int, critic: Any = None, rollouts: Any = None,
                        shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Every trainer rank calls this (the weights are gathered for policy/ and the sharded
    training state written collectively); rank 0 writes the other files. A critic (estimator
    gae) is saved under `critic/`, the episodes in flight (`rollouts`, a RolloutSnapshot,
    rank 0's) as `rollouts.pkl`. `policy/` is written by save_pretrained (safetensors files of
    at most `shard_size`, the base model's generation config, the tokenizer)."""
    from asyncrl.models.export import save_weights_dir
    from asyncrl.train.checkpoint import save_state

    final = step_dir(run_dir, state.step)
    tmp = final.parent / f".{final.name}.tmp"
    weights = trainer.model_state_dict()  # full on rank 0 (collective under FSDP)
    writer = trainer.rank == 0
    if writer:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        save_weights_dir(weights, trainer.model.config, tmp / POLICY, tokenizer,
                         generation_config=getattr(trainer.model, "generation_config", None),
                         max_shard_size=shard_size)
        del weights  # under FSDP rank 0's gathered copy: gone before the DCP save below
    if getattr(trainer, "lora", None) is not None:  # train.lora: the adapter, PEFT's layout
        _save_adapter(trainer, tmp / ADAPTER)  # collective under FSDP (one gather per matrix)
    # policy/ holds the full weights already: the trainer state keeps only its shards (the
    # critic keeps its model.safetensors: the one unsharded copy of the value model)
    save_state(tmp / TRAINER, trainer.parallel, {"engine": trainer})
    if critic is not None:
        save_state(tmp / CRITIC, critic.parallel, {"engine": critic})
    if not writer:
        return final
    if rollouts is not None:
        rollouts.save(tmp / ROLLOUTS)
    (tmp / STATE).write_text(json.dumps(asdict(state), indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest = final.parent / LATEST
    latest.with_suffix(".tmp").write_text(final.name)
    os.replace(latest.with_suffix(".tmp"), latest)
    _prune(final.parent, keep)
    return final


def _save_adapter(trainer: Any, path: Path) -> None:
    """PeftModel.save_pretrained's files, loadable onto the base model by PEFT or vLLM."""
    from asyncrl.models.lora import write_adapter_dir
    from asyncrl.train.lora import peft_config_dict

    adapter = trainer.adapter_state_dict()
    if trainer.rank == 0:
        write_adapter_dir(adapter, peft_config_dict(trainer.model), path)


def _prune(checkpoints: Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in step_dirs(checkpoints)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path:
    """The checkpoint `--resume` continues from: the one `latest` names, else the newest complete
    one (a resume should go on from what is there rather than stop at a stale `latest`)."""
    checkpoints = run_dir / CHECKPOINTS
    name = read_latest(checkpoints)
    named = [checkpoints / name] if name else []
    for path in [*named, *reversed(step_dirs(checkpoints))]:
        if (path / STATE).is_file():
            return path
    raise UserError(f"--resume {run_dir}: no checkpoint found under {checkpoints} "
                    "(expected step_NNNNNN/ directories written by asyncrl train)")


def load_loop_state(ckpt: Path) -> LoopState:
    state = json.loads((ckpt / STATE).read_text())
    state.pop("version", None)  # written by earlier releases; the trainer's state holds it
    return LoopState(**state)


def load_rollouts(ckpt: Path) -> Any:
    """The checkpoint's RolloutSnapshot, or None (written before episodes were kept)."""
    from asyncrl.rollout.snapshot import RolloutSnapshot

    path = ckpt / ROLLOUTS
    return RolloutSnapshot.load(path) if path.is_file() else None


def _is_model_dir(p: Path) -> bool:
    return (p / "config.json").is_file()


def latest_step_dir(checkpoints: Path) -> Path | None:
    """The step directory `latest` names, else the highest step_NNNNNN; None when there is none.
    A `latest` naming no directory is a UserError: the user pointed at it and should know."""
    name = read_latest(checkpoints)
    if name is None:
        steps = step_dirs(checkpoints)
        return steps[-1] if steps else None
    target = checkpoints / name  # an absolute path in the file stays absolute
    if not name or not target.is_dir():
        raise UserError(f"{checkpoints / LATEST} names {name!r}, which is not a directory under "
                        f"{checkpoints}")
    return target


def find_policy_dir(path: str | Path) -> Path:
    """The HF model directory inside `path`: `path` itself (config.json), a training checkpoint's
    `policy/`, or a run directory's latest `checkpoints/step_NNNNNN/policy/`."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"checkpoint {p} not found; expected a HF model dir, a checkpoint dir "
                        "(policy/) or a run dir (checkpoints/step_NNNNNN/)")
    if _is_model_dir(p):
        return p
    if _is_model_dir(p / POLICY):
        return p / POLICY
    checkpoints = p / CHECKPOINTS
    if checkpoints.is_dir():
        step = latest_step_dir(checkpoints)
        if step is not None:
            if _is_model_dir(step / POLICY):
                return step / POLICY
            raise UserError(f"checkpoint {step} has no policy/config.json; expected the HF "
                            "model directory the train loop writes there")
    raise UserError(f"{p} is not a model or checkpoint: looked for {p}/config.json (HF model "
                    f"dir), {p}/policy/config.json (checkpoint) and {p}/checkpoints/"
                    "step_NNNNNN/policy/config.json (run dir)")
