"""Protocols and data types shared by every layer.

Importing this package must stay cheap: stdlib and typing only (no torch, fastapi, transformers);
a test enforces it.
"""

from asyncrl.api.episode import EpisodeRejected, EpisodeSuspended
from asyncrl.api.generation import GenerationConfig, ModelRequest, ModelResponse, StopReason
from asyncrl.api.protocols import (
    Agent,
    AgentAction,
    AgentProgram,
    Closable,
    Environment,
    EvalReport,
    Evaluator,
    InferenceEngine,
    ReportsMetrics,
    RolloutWorkflow,
    ServingEngine,
    Stateful,
    TrainEngine,
)
from asyncrl.api.loss import LossInputs, PolicyLoss
from asyncrl.api.images import ImageInputs
from asyncrl.api.trajectory import PROMPT_VERSION, RolloutStatus, Sample, Trajectory
from asyncrl.api.validation import check_choice, check_range
from asyncrl.api.version import PolicyVersion
from asyncrl.api.weights import WeightUpdateKind, WeightUpdateMeta

__all__ = [
    "Agent",
    "AgentAction",
    "AgentProgram",
    "Closable",
    "Environment",
    "EpisodeRejected",
    "EpisodeSuspended",
    "EvalReport",
    "Evaluator",
    "GenerationConfig",
    "InferenceEngine",
    "LossInputs",
    "ModelRequest",
    "ModelResponse",
    "PROMPT_VERSION",
    "PolicyLoss",
    "PolicyVersion",
    "ReportsMetrics",
    "RolloutStatus",
    "RolloutWorkflow",
    "Sample",
    "ImageInputs",
    "ServingEngine",
    "Stateful",
    "StopReason",
    "TrainEngine",
    "Trajectory",
    "WeightUpdateKind",
    "WeightUpdateMeta",
    "check_choice",
    "check_range",
]
