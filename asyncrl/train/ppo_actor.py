"""The PPO/GRPO actor: one policy update from a batch of finished trajectories.

    samples -> [reference logprobs if KL is on] -> [proximal logprobs: recompute forward]
            -> advantages (one call over the whole batch, groups = trajectories)
            -> train_batch with the decoupled PPO actor loss per packed micro-batch

Everything step-specific is computed once for the batch and handed to the train engine as
input-aligned per-token `token_data`, so micro-batching never changes a group baseline or the
loss normaliser. The loss functions themselves stay pure (`losses`, `advantages`, `proximal`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pydantic
import torch

from asyncrl.api.trajectory import Sample, Trajectory
from asyncrl.config import Config
from asyncrl.train.advantages import AdvantageConfig, AdvantageInputs, compute_advantages
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.losses import PPOLossConfig, ppo_actor_loss
from asyncrl.train.proximal import ProximalConfig, approx_proximal_logprobs


class PPOActorConfig(Config):
    ppo: PPOLossConfig = PPOLossConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    proximal: ProximalConfig = ProximalConfig()
    # Optimizer steps per batch, each on a slice of whole groups; the proximal policy and the
    # advantages stay those of the start of the batch, so from the second step on the PPO clip
    # bounds how far the policy moves. The policy version still advances by one per batch.
    ppo_n_minibatches: int = pydantic.Field(1, ge=1)


def _padded(rows: Sequence[Sequence[float]], dtype: torch.dtype) -> torch.Tensor:
    """[N, T] right-padded with zeros."""
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def flatten(trajectories: Sequence[Trajectory]) -> tuple[list[Sample], torch.Tensor]:
    """All samples of the batch and their group index [N] (one group per trajectory)."""
    samples, groups = [], []
    for g, traj in enumerate(trajectories):
        samples += traj.samples
        groups += [g] * len(traj.samples)
    return samples, torch.tensor(groups, dtype=torch.long)


def minibatches(groups: torch.Tensor, n: int) -> list[list[int]]:
    """Sample indices in `n` contiguous slices of whole groups (fewer if there are fewer groups)."""
    ids = groups.tolist()
    order = list(dict.fromkeys(ids))
    n = max(1, min(n, len(order)))
    bounds = [round(i * len(order) / n) for i in range(n + 1)]
    slices = [set(order[bounds[i]:bounds[i + 1]]) for i in range(n)]
    return [[i for i, g in enumerate(ids) if g in part] for part in slices]


def _unpad(x: torch.Tensor, samples: Sequence[Sample]) -> list[list[float]]:
    return [x[i, : len(s.input_ids)].tolist() for i, s in enumerate(samples)]


class PPOActor:
    """Owns no model: drives a trainable `HFTrainEngine` (and an optional frozen reference)."""

    def __init__(self, engine: HFTrainEngine, cfg: PPOActorConfig,
                 ref: HFTrainEngine | None = None) -> None:
        if cfg.ppo.kl_coef > 0 and ref is None:
            raise ValueError(f"ppo.kl_coef={cfg.ppo.kl_coef} > 0 needs a reference model; "
                             "pass ref=HFTrainEngine(..., trainable=False) or set ppo.kl_coef=0")
        if cfg.ppo.kl_coef > 0 and cfg.ppo.kl_as == "reward" and cfg.advantage.estimator != "gae":
            raise ValueError(f"ppo.kl_as='reward' needs advantage.estimator='gae' (per-token "
                             f"rewards); got {cfg.advantage.estimator!r}; use ppo.kl_as='loss'")
        if cfg.ppo.entropy_coef > 0:
            raise ValueError(f"ppo.entropy_coef={cfg.ppo.entropy_coef}: the actor's train engine "
                             "returns logprobs only, so the entropy bonus is not available here; "
                             "allowed: 0")
        self.engine, self.cfg, self.ref = engine, cfg, ref
        self._version = engine.get_version()  # of the weights the current batch started from

    def token_data(self, samples: Sequence[Sample], groups: torch.Tensor
                   ) -> tuple[dict[str, list[list[float]]], dict[str, float]]:
        """Per-token advantages (+ proximal / reference logprobs) for the whole batch."""
        mask = _padded([s.loss_mask for s in samples], torch.float32)
        inputs = AdvantageInputs(
            rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
            loss_mask=mask, group_ids=groups,
            truncated=torch.tensor([s.truncated for s in samples], dtype=torch.bool))
        result = compute_advantages(inputs, self.cfg.advantage)
        data = {"advantages": _unpad(result.advantages, samples),
                "adv_loss_mask": _unpad(result.loss_mask.float(), samples)}
        if self.cfg.proximal.needs_forward_pass:
            data["proximal_logprobs"] = [t.tolist() for t in self.engine.forward(samples)]
        if self.ref is not None:
            data["ref_logprobs"] = [t.tolist() for t in self.ref.forward(samples)]
        return data, result.stats

    def loss_fn(self, logprobs: torch.Tensor, t: Mapping[str, torch.Tensor],
                normalizer: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        behaviour = t["behaviour_logprobs"]
        source = self.cfg.proximal.proximal_logprobs
        if source == "recompute":
            proximal = t["proximal_logprobs"]
        elif source == "loglinear":
            proximal = approx_proximal_logprobs(behaviour, logprobs, t["versions"],
                                                self._version)
        else:
            proximal = behaviour
        mask = t["loss_mask"] & t["adv_loss_mask"].bool()
        return ppo_actor_loss(logprobs, proximal, behaviour, t["advantages"], mask, normalizer,
                              self.cfg.ppo, ref_logprobs=t.get("ref_logprobs"))

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """`ppo_n_minibatches` optimizer steps, policy version + 1; returns the stats (mean
        over minibatches)."""
        samples, groups = flatten(trajectories)
        if not samples:
            raise ValueError("train_step got trajectories with no samples")
        data, stats = self.token_data(samples, groups)
        self._version = version = self.engine.get_version()
        per_mb: list[dict[str, float]] = []
        for part in minibatches(groups, self.cfg.ppo_n_minibatches):
            per_mb.append(self.engine.train_batch(
                [samples[i] for i in part], self.loss_fn,
                {k: [v[i] for i in part] for k, v in data.items()}))
        self.engine.set_version(version + 1)
        for key in per_mb[0]:
            stats[key] = sum(st.get(key, 0.0) for st in per_mb) / len(per_mb)
        stats["ppo/minibatches"] = float(len(per_mb))
        return stats
