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
from asyncrl.api.images import ImageInputs
from asyncrl.launch.run_checkpoints import RunCheckpointer
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.parallel import Parallelism, SingleProcess
from asyncrl.train.ppo_actor import PPOActor


def parallelism(device: str | None) -> Parallelism:
    """FSDP2 over the ranks torchrun (or a Ray launcher) started, or one process; `device`: the
    trainer's (train.device), which picks NCCL or gloo."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return SingleProcess()
    from asyncrl.train.fsdp import FSDP2

    return FSDP2(device)


class TrainerGroup:
    def __init__(self, trainer: HFTrainEngine, actor: PPOActor) -> None:
        """`actor` drives `trainer` (and the reference and critic it was given); every rank
        must be given the same parts."""
        self.trainer, self.actor, self.parallel = trainer, actor, trainer.parallel

    def _command(self, name: str, payload: Any = None) -> None:
        if self.parallel.world_size > 1:
            self.parallel.broadcast_object((name, payload))

    # ---- rank 0 ---------------------------------------------------------------------------------
    def train_step(self, trajs: list[Trajectory]) -> dict[str, float]:
        self._command("train", trajs)
        return self.actor.train_step(trajs)

    def score(self, prompt_ids: list[int], output_ids: list[int],
              images: ImageInputs | None = None) -> list[float]:
        """The trainer's logprobs of `output_ids` after `prompt_ids` (with the prompt's
        `images`; every rank computes them: under FSDP the forward is collective)."""
        self._command("score", (prompt_ids, output_ids, images))
        return _score(self.trainer, prompt_ids, output_ids, images)

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
            name, payload = self.parallel.broadcast_object(None)
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


def _score(trainer: HFTrainEngine, prompt_ids: list[int], output_ids: list[int],
           images: ImageInputs | None = None) -> list[float]:
    n = len(output_ids)
    sample = Sample.from_prompt_and_completion(prompt_ids, output_ids, [0.0] * n, [0] * n)
    sample.images = images
    return trainer.forward([sample])[0][-n:].tolist() if n else []
