"""asyncrl: asynchronous reinforcement learning for LLM reasoning models and agents.

Generation and training run side by side: inference engines produce rollouts tagged with the
policy version of every token, the trainer consumes them under a staleness bound and pushes new
weights back. See README.md for the two-command quick start and docs/concepts/architecture.md for the map.

    from asyncrl import Trainer, TrainRunConfig
    Trainer("configs/train_tiny.yaml").train(workflow=my_workflow, loss=my_loss)

The names below load on first use, so `import asyncrl.api` stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Trainer": "asyncrl.launch.train",
    "TrainResult": "asyncrl.launch.train",
    "TrainRunConfig": "asyncrl.launch.train_config",
    "RLVRWorkflow": "asyncrl.rollout.rlvr",
    "GroupedWorkflow": "asyncrl.rollout.group",
    "MultiTurnWorkflow": "asyncrl.rollout.multi_turn",
    "AgentWorkflow": "asyncrl.proxy.workflow",
    "run_eval_job": "asyncrl.launch.evaluate",
    "run_sft_job": "asyncrl.launch.sft",
    "SFTRunConfig": "asyncrl.launch.sft_config",
    "open_reward": "asyncrl.reward.config",
    "RewardPool": "asyncrl.reward.pool",
    "PPOLoss": "asyncrl.train.losses",
    "PPOLossConfig": "asyncrl.train.config",
}
_API = ("EpisodeRejected", "EvalReport", "Evaluator", "GenerationConfig", "InferenceEngine",
        "LossInputs", "ModelRequest", "ModelResponse", "PolicyLoss", "ReportsMetrics",
        "RolloutWorkflow", "Sample", "Trajectory", "AgentProgram")
_LAZY.update({name: "asyncrl.api" for name in _API})

__all__ = ["__version__", *sorted(_LAZY)]


def __dir__() -> list[str]:
    """The lazy names too, so tab completion offers `Trainer` before it is loaded."""
    return sorted({*globals(), *_LAZY})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")
