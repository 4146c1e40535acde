"""The trainer as one process or as a torchrun group (FSDP2), behind one object.

Under torchrun, rank 0 runs everything a job has besides training (engines, executor, eval, logs)
and drives the other ranks: before each collective trainer operation it broadcasts a command
(train this batch / gather the weights / write a checkpoint / stop), and the other ranks sit in
`follow()` executing the same operations in the same order, which is what FSDP's collectives
need. With one process the commands are plain calls.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from asyncrl.api import Sample, Trajectory
from asyncrl.launch.run_checkpoints import RunCheckpointer
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.parallel import Parallelism, SingleProcess
from asyncrl.train.ppo_actor import PPOActor
from asyncrl.train.config import CriticConfig, TrainEngineConfig


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_distributed() -> bool:
    return world_size() > 1


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def parallelism() -> Parallelism:
    """FSDP2 over the torchrun ranks, or one process."""
    if not is_distributed():
        return SingleProcess()
    from asyncrl.train.fsdp import FSDP2

    return FSDP2()


def load_engine(path: Path, cfg: TrainEngineConfig, dtype: str, trust_remote_code: bool = False,
                **kwargs: Any) -> HFTrainEngine:
    """HFTrainEngine on one process, sharded by FSDP2 under torchrun."""
    from asyncrl.models.loading import load_causal_lm

    return HFTrainEngine(load_causal_lm(path, dtype, trust_remote_code), cfg,
                         parallel=parallelism(), **kwargs)


def load_critic(path: Path, cfg: CriticConfig, dtype: str, total_steps: int,
                trust_remote_code: bool = False) -> HFTrainEngine:
    """A value head on the policy's body, sharded like the policy under torchrun."""
    from asyncrl.models.loading import load_causal_lm
    from asyncrl.train.critic import critic_engine

    return critic_engine(load_causal_lm(path, dtype, trust_remote_code), cfg, total_steps,
                         parallelism())


def leave_process_group() -> None:
    """Tear the process group down before exit (every rank): gloo's threads left running at
    interpreter exit abort the process ("terminate called without an active exception")."""
    if not is_distributed():
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def broadcast(obj: Any) -> Any:
    """rank 0's `obj` on every rank (a no-op on one process)."""
    if not is_distributed():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TrainerGroup:
    def __init__(self, trainer: HFTrainEngine, actor: PPOActor, tokenizer: Any) -> None:
        """`actor` drives `trainer` (and the reference and critic it was given); every rank
        must be given the same parts."""
        self.trainer, self.actor, self.tokenizer = trainer, actor, tokenizer
        self.distributed = is_distributed()

    def _command(self, name: str, payload: Any = None) -> None:
        if self.distributed:
            broadcast((name, payload))

    # ---- rank 0 ---------------------------------------------------------------------------------
    def train_step(self, trajs: list[Trajectory]) -> dict[str, float]:
        self._command("train", trajs)
        return self.actor.train_step(trajs)

    def score(self, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
        """The trainer's logprobs of `output_ids` after `prompt_ids` (every rank computes them:
        under FSDP the forward is collective)."""
        self._command("score", (prompt_ids, output_ids))
        return _score(self.trainer, prompt_ids, output_ids)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What the engines are sent (on rank 0): the full weights, or with train.lora the
        adapter only."""
        self._command("state_dict")
        return self.trainer.engine_weights()

    def checkpoint(self, checkpointer: RunCheckpointer, step: int) -> Path:
        """Every rank writes checkpoint `step` with its own checkpointer."""
        self._command("checkpoint", step)
        return checkpointer.save(step)

    def load(self, checkpointer: RunCheckpointer, ckpt: Path) -> None:
        """Every rank restores its parts from `ckpt`."""
        self._command("load", ckpt)
        checkpointer.load(ckpt)

    def stop(self) -> None:
        self._command("stop")

    # ---- ranks > 0 ------------------------------------------------------------------------------
    def follow(self, checkpointer: RunCheckpointer) -> None:
        """Mirror rank 0's collective operations until it sends stop."""
        while True:
            name, payload = broadcast(None)
            if name == "train":
                self.actor.train_step(payload)
            elif name == "score":
                _score(self.trainer, *payload)
            elif name == "state_dict":
                self.trainer.engine_weights()
            elif name == "checkpoint":
                checkpointer.save(payload)
            elif name == "load":
                checkpointer.load(payload)
            elif name == "stop":
                return
            else:
                raise RuntimeError(f"unknown trainer command {name!r} from rank 0")


def _score(trainer: HFTrainEngine, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    n = len(output_ids)
    sample = Sample.from_prompt_and_completion(prompt_ids, output_ids, [0.0] * n, [0] * n)
    return trainer.forward([sample])[0][-n:].tolist() if n else []
