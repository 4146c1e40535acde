"""The narrow interfaces the layers talk through.

Each Protocol names only what its callers use, so a remote vLLM client, the built-in engine and a
test double are interchangeable without sharing a base class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, SupportsFloat, runtime_checkable

from asyncrl.api.generation import ModelRequest, ModelResponse
from asyncrl.api.trajectory import Sample, Trajectory
from asyncrl.api.version import PolicyVersion
from asyncrl.api.weights import WeightUpdateMeta

if TYPE_CHECKING:  # keep `import asyncrl.api` free of torch and gymnasium
    import gymnasium
    import torch


@runtime_checkable
class InferenceEngine(Protocol):
    """Generates tokens: what a workflow, an agent proxy or an evaluation is handed (the
    built-in engine, the remote HTTP client, a test double)."""

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generates one sequence for `req`.

        Args:
            req: the prompt's token ids and its sampling settings; one request is one sequence,
                so `req.gconfig.n_samples` is 1 (issue one request per sample).

        Returns:
            The response: every output token with the logprob it was sampled with and the policy
            version that produced it. A generation cut short (a weight update, a pause, an
            interrupt) returns its partial output with `stop_reason` ABORT.

        Raises:
            ValueError: the engine cannot serve the request as it is (e.g. the prompt plus
                `max_new_tokens` exceed its context, token ids out of its vocabulary).
            EpisodeSuspended: inside an episode the executor suspends for a checkpoint; let it
                propagate.
        """

    def get_version(self) -> int:
        """Returns the policy version of the weights the engine serves now."""


@runtime_checkable
class ServingEngine(InferenceEngine, Protocol):
    """An engine a training job serves its policy with: it pauses, takes new weights, and is
    checked. The built-in engine (asyncrl/inference/async_engine.py) and the remote client
    (asyncrl/inference/remote.py) implement it."""

    def pause(self) -> None:
        """Stop scheduling new work; in-flight requests are aborted and return partial output."""

    def resume(self) -> None: ...

    def interrupt(self) -> None:
        """Every generation in flight returns now with its partial output, new ones return
        empty, until `resume` (a checkpoint suspends the episodes in flight this way)."""

    async def update_weights(self, meta: WeightUpdateMeta,
                             weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Load new weights and set the engine's version to `meta.version` atomically.

        `meta.kind` says how they travel: DISK reads `meta.path` (no `weights`); TENSORS takes
        `weights` (full HF-named tensors: in memory in process, streamed in buckets over HTTP)."""

    async def check_servers(self, model_dir: str | None = None) -> None:
        """Raise, naming the fix, if a server this engine drives cannot be used (version range,
        routes, logprobs mode, a model of another shape than `model_dir`'s); nothing to check
        in process."""

    async def generate_on_each(self, req: ModelRequest) -> list[tuple[str, ModelResponse]]:
        """`req` generated once by every healthy server (or the in-process engine), each with
        its name: the logprob canary compares each with the trainer."""


@runtime_checkable
class Closable(Protocol):
    """A workflow (or an agent behind one) that holds resources to release at the run's end."""

    async def aclose(self) -> None: ...


@runtime_checkable
class Stateful(Protocol):
    """A part of a run a checkpoint saves and restores (an engine, the rollout executor, the data
    stream, the loop's counters): torch.distributed.checkpoint's Stateful."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class TrainEngine(Stateful, Protocol):
    """Owns a trainable model (policy, reference or critic) and its optimizer."""

    version: PolicyVersion  # of the weights it trains; the policy update advances it

    def train_batch(self, samples: list[Sample], loss_fn: Callable[..., Any],
                    token_data: Mapping[str, list[torch.Tensor]] | None = None,
                    normalize_by: str = "tokens", with_entropy: bool = False,
                    ) -> dict[str, float]:
        """One optimizer step over `samples`, packed into micro-batches with `token_data` (one
        input-aligned tensor per sample and name). `loss_fn(outputs, micro_batch, normalizer)`
        runs per micro-batch (the PPO actor adapts a `PolicyLoss` to it, train/ppo_actor.py);
        the normaliser counts the step's trained "tokens" or "sequences" over every micro-batch
        and rank; `with_entropy` adds each token's entropy to the micro-batch."""

    def forward(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-token outputs of each sample (logprobs of a policy, values of a critic), without
        gradients."""

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """What the inference engines are sent (full weights, or a LoRA adapter)."""


@runtime_checkable
class RolloutWorkflow(Protocol):
    """User rollout logic at the lowest level: one episode in, training data out."""

    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> Trajectory | None:
        """Return None to reject the episode (it is counted, not trained on)."""


@dataclass
class EvalReport:
    """What one evaluation found: `score` is the headline (higher is better) that the run's
    result and curve record; `metrics` are logged as they are (name them `eval/...`)."""

    score: float
    name: str = "reward"  # what `score` is, for the console: "greedy accuracy", "agent reward"
    metrics: dict[str, float] = field(default_factory=dict)
    detail: str = ""  # the rest of the console line, e.g. ", pass@8 61.2%"
    # per row id, the greedy answer and its reward, where the evaluator has them: the run shows
    # a few (an image grid of the eval rows with images)
    answers: dict[str, tuple[str, float]] = field(default_factory=dict)


@runtime_checkable
class Evaluator(Protocol):
    """Scores the current policy on held-out rows. A workflow that has this method brings its
    own evaluation; otherwise the trainer runs the workflow once per row and averages rewards."""

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> EvalReport:
        """Scores the policy behind `engine` on `rows`.

        Args:
            engine: the engine serving the current policy.
            rows: the held-out data rows (the same shape as the training rows).

        Returns:
            The report: `score` is the headline (higher is better), `metrics` are logged.
        """


@runtime_checkable
class ReportsMetrics(Protocol):
    """A workflow or a reward with `metrics()` has them logged after every training step."""

    def metrics(self) -> dict[str, float]:
        """Returns the values to log now, by metric name."""


@runtime_checkable
class Environment(Protocol):
    """A Gym-like environment with async reset/step, so thousands can share one event loop."""

    observation_space: gymnasium.spaces.Space
    action_space: gymnasium.spaces.Space

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]: ...

    async def step(
        self, action: Any
    ) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Return (observation, reward, terminated, truncated, info) like gymnasium.Env.step."""


@dataclass
class AgentAction:
    """What an Agent decided, plus the generation that produced it (the training data)."""

    action: Any
    response: ModelResponse | None = None


@runtime_checkable
class Agent(Protocol):
    """Turns observations into actions by querying an inference engine."""

    async def reset(self) -> None: ...

    async def act(self, engine: InferenceEngine, observation: Any) -> AgentAction: ...


@runtime_checkable
class AgentProgram(Protocol):
    """Any agent that talks to an OpenAI-compatible endpoint and returns its reward.

    `extra_kwargs` carries `base_url`, `api_key` (per session) and a shared `http_client`. A float
    rewards the last completion; a dict maps completion ids to rewards.
    """

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float | dict[str, float]:
        """Runs the agent on one data row against the endpoint it is given.

        Args:
            data: the data row (e.g. `data["messages"]`, `data["answer"]`).
            **extra_kwargs: `base_url` and `api_key` of this run's session, and, when the agent
                runs on the rollout event loop, a shared async `http_client`.

        Returns:
            The reward: a float for the last completion, or a dict mapping completion ids to
            rewards. An `AgentWorkflow` with a reward function also takes None: it then scores
            the session's last reply itself.
        """
