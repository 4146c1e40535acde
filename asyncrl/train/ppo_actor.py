"""The PPO/GRPO actor: one policy update from a batch of finished trajectories.

    samples -> [reference logprobs if KL is on] -> [proximal logprobs: recompute forward]
            -> advantages (one call over the whole batch, groups = trajectories)
            -> train_batch: the configured PolicyLoss on each packed micro-batch

Everything step-specific is computed once for the batch as input-aligned per-token tensors
(`token_data`) and packed with the samples, so micro-batching never changes a group baseline or
the loss normaliser. The loss itself is a `PolicyLoss` (api/loss.py): the built-in decoupled PPO
loss (`losses.PPOLoss`) or a user's, which receives the same typed `LossInputs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from asyncrl.api.loss import LossInputs, PolicyLoss
from asyncrl.api.trajectory import Sample, Trajectory
from asyncrl.train.advantages import AdvantageInputs, compute_advantages
from asyncrl.train.critic import critic_token_loss, values_and_end_values
from asyncrl.train.losses import behaviour_weight
from asyncrl.train.regularizers import kl_reward
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.mismatch import MismatchMonitor, unreplayed_gap, unreplayed_tokens
from asyncrl.train.route_replay import Mode
from asyncrl.train.packing import PackedMicroBatch, unpack
from asyncrl.train.proximal import proximal_logprobs
from asyncrl.train.config import PPOActorConfig


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


def _padded_mask(samples: Sequence[Sample]) -> torch.Tensor:
    """loss_mask as [N, T], right-padded with zeros."""
    width = max(len(s.loss_mask) for s in samples)
    out = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        out[i, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    return out


def _padded(rows: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """One tensor per sample -> [N, T] like `like`, right-padded with zeros."""
    out = torch.zeros_like(like, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r.float()
    return out


def _rows(x: torch.Tensor, samples: Sequence[Sample]) -> list[torch.Tensor]:
    """[N, T] padded -> one unpadded row per sample (views, no copy)."""
    return [x[i, : len(s.input_ids)] for i, s in enumerate(samples)]


class PPOActor:
    """Owns no model: drives a trainable `HFTrainEngine` (and an optional frozen reference)."""

    def __init__(self, engine: HFTrainEngine, cfg: PPOActorConfig,
                 ref: HFTrainEngine | None = None, loss: PolicyLoss | None = None,
                 critic: HFTrainEngine | None = None,
                 value_eps_clip: float | None = 0.2, record_groups: int = 0) -> None:
        """`critic` (estimator gae) regresses on each batch's returns, its update clipped by
        `value_eps_clip` around the values it had when the batch arrived (None: no clip).
        `record_groups`: keep the trainer's per-token logprobs and advantages of the first that
        many groups of each batch for `take_record` (what a person inspects; 0: none)."""
        if cfg.ppo.kl_coef > 0 and ref is None:
            raise ValueError(f"ppo.kl_coef={cfg.ppo.kl_coef} > 0 needs a reference model; "
                             "pass ref=HFTrainEngine(..., trainable=False) or set ppo.kl_coef=0")
        if cfg.ppo.kl_coef > 0 and cfg.ppo.kl_as == "reward" and cfg.advantage.estimator != "gae":
            raise ValueError(f"ppo.kl_as='reward' needs advantage.estimator='gae' (per-token "
                             f"rewards); got {cfg.advantage.estimator!r}; use ppo.kl_as='loss'")
        if (cfg.advantage.estimator == "gae") != (critic is not None):
            raise ValueError(f"advantage.estimator={cfg.advantage.estimator!r} "
                             + ("needs a critic (critic=load_critic(...))" if critic is None
                                else "takes no critic; only 'gae' uses one"))
        self.engine, self.cfg, self.ref, self.critic = engine, cfg, ref, critic
        self.value_eps_clip = value_eps_clip
        self.loss: PolicyLoss = loss if loss is not None else cfg.loss.build(cfg)
        self._batch_version = engine.version.value  # the weights the current batch started from
        self.monitor = MismatchMonitor()
        self._watching = False
        self.record_groups = record_groups
        self._recording: set[int] = set()  # batch indices of the samples to record
        self._record: dict[int, dict[str, list[float]]] = {}

    def token_data(self, samples: Sequence[Sample], groups: torch.Tensor
                   ) -> tuple[dict[str, list[torch.Tensor]], dict[str, float]]:
        """Per-token advantages (+ proximal / reference logprobs, the critic's values and
        returns) for the whole batch."""
        mask = _padded_mask(samples)
        data: dict[str, list[torch.Tensor]] = {}
        if self.ref is not None:
            data["ref_logprobs"] = self.ref.forward(samples)
        values = token_rewards = end_values = None
        if self.critic is not None:
            if self.cfg.advantage.truncated_bootstrap:
                data["old_values"], end_values = values_and_end_values(self.critic, samples)
            else:
                data["old_values"] = self.critic.forward(samples)
            values = _padded(data["old_values"], mask)
            if self.cfg.ppo.kl_coef > 0 and self.cfg.ppo.kl_as == "reward":
                behaviour = _padded([torch.tensor(s.logprobs) for s in samples], mask)
                token_rewards = kl_reward(torch.zeros_like(mask), behaviour,
                                          _padded(data["ref_logprobs"], mask), mask,
                                          self.cfg.ppo.kl_coef, self.cfg.ppo.kl_kind)
        inputs = AdvantageInputs(
            rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
            loss_mask=mask, group_ids=groups, values=values, token_rewards=token_rewards,
            truncated=torch.tensor([s.truncated for s in samples], dtype=torch.bool),
            end_values=end_values)
        result = compute_advantages(inputs, self.cfg.advantage)
        data["advantages"] = _rows(result.advantages, samples)
        data["adv_loss_mask"] = _rows(result.loss_mask.float(), samples)
        if result.returns is not None:
            data["returns"] = _rows(result.returns, samples)
        if self.cfg.proximal.needs_forward_pass:
            data["proximal_logprobs"] = self.engine.forward(samples)
        if token_rewards is not None:
            result.stats["actor/kl_reward_mean"] = float(-token_rewards.sum() / mask.sum().clamp(min=1))
        return data, result.stats

    def _drop_bounded_tokens(self, samples: Sequence[Sample], data: dict[str, list[torch.Tensor]],
                             stats: dict[str, float]) -> list[Sample]:
        """The samples with the tokens the mask / icepop bound drops taken out of their loss
        mask, so they leave the step's normaliser as well as its loss."""
        out, dropped_total = [], 0
        for s, prox in zip(samples, data["proximal_logprobs"]):
            mask = torch.tensor(s.loss_mask, dtype=torch.bool)
            behaviour = torch.tensor(s.logprobs, dtype=prox.dtype)
            if prox.shape != mask.shape:
                raise ValueError(f"proximal logprobs of shape {tuple(prox.shape)} for a sample "
                                 f"of {mask.numel()} tokens")
            _, dropped = behaviour_weight(prox.cpu(), behaviour, mask, self.cfg.ppo)
            dropped_total += int(dropped.sum())
            kept = (mask & ~dropped).int().tolist()
            out.append(dataclasses.replace(s, loss_mask=kept) if dropped.any() else s)
        stats["ppo/renormalized_dropped_tokens"] = float(dropped_total)
        return out

    def loss_inputs(self, logprobs: torch.Tensor, mb: PackedMicroBatch) -> LossInputs:
        """The typed per-token inputs of one micro-batch, proximal logprobs resolved."""
        behaviour, t = mb.behaviour_logprobs, mb.tensors
        proximal = proximal_logprobs(self.cfg.proximal, behaviour, logprobs, mb.versions,
                                     self._batch_version, t.get("proximal_logprobs"))
        return LossInputs(
            loss_mask=mb.loss_mask & t["adv_loss_mask"].bool(), behaviour_logprobs=behaviour,
            proximal_logprobs=proximal, advantages=t["advantages"], versions=mb.versions,
            seq_id=mb.seq_id, ref_logprobs=t.get("ref_logprobs"), entropy=t.get("entropy"),
            policy_version=self._batch_version)

    def _micro_batch_loss(self, logprobs: torch.Tensor, mb: PackedMicroBatch,
                          normalizer: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        inputs = self.loss_inputs(logprobs, mb)
        if self._watching:  # the first minibatch: the weights the batch started from
            self.monitor.add(logprobs, inputs)
            if self._recording:
                for i, lp in zip(mb.sample_index, unpack(logprobs.detach().reshape(-1), mb)):
                    if i in self._recording:
                        self._record.setdefault(i, {})["trainer_logprobs"] = \
                            lp.float().cpu().tolist()
        return self.loss(logprobs, inputs, normalizer)

    def _unreplayed(self, samples: list[Sample]) -> dict[str, float]:
        """Under routing replay, before the update: the gap the same weights show without replay
        (one more forward; its route flips are the step's moe/route_flip_frac) and the tokens
        it could not replay."""
        routing = self.engine.routing
        if routing is None or routing.mode != Mode.REPLAY or all(
                s.routes is None for s in samples):
            return {}
        with routing.observing():
            stats = unreplayed_gap(self.engine.forward(samples), samples,
                                   self.engine.version.value)
        stats["moe/unreplayed_tokens"] = float(unreplayed_tokens(samples))
        return stats

    def take_record(self) -> dict[int, dict[str, list[float]]]:
        """The last step's recorded samples by batch index: `trainer_logprobs` (the policy the
        step started from; present for the samples this rank trained in its first minibatch)
        and `advantages`, each aligned with the sample's tokens. Empty afterwards."""
        record, self._record = self._record, {}
        return record

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """`ppo_n_minibatches` optimizer steps, then the policy version advances by one; returns
        the stats (mean over minibatches)."""
        samples, groups = flatten(trajectories)
        if not samples:
            raise ValueError("train_step got trajectories with no samples")
        data, stats = self.token_data(samples, groups)
        self._recording = {i for i, g in enumerate(groups.tolist()) if g < self.record_groups}
        self._record = {i: {"advantages": data["advantages"][i].float().tolist()}
                        for i in self._recording}
        if self.cfg.ppo.behav_imp_weight_renormalize:
            samples = self._drop_bounded_tokens(samples, data, stats)
        self._batch_version = self.engine.version.value
        stats.update(self._unreplayed(samples))
        per_mb: list[dict[str, float]] = []
        for k, part in enumerate(minibatches(groups, self.cfg.ppo_n_minibatches)):
            self._watching = k == 0
            per_mb.append(self.engine.train_batch(
                [samples[i] for i in part], self._micro_batch_loss,
                {k: [v[i] for i in part] for k, v in data.items()},
                normalize_by=self.loss.normalize_by, with_entropy=self.loss.needs_entropy))
        self._watching = False
        self.engine.version.advance()
        for key in per_mb[0]:
            stats[key] = sum(st.get(key, 0.0) for st in per_mb) / len(per_mb)
        stats.update(self.monitor.summary())
        if self.engine.routing is not None:
            stats.update(self.engine.routing.take_metrics())
        if self.critic is not None:  # the critic regresses on this batch's GAE returns
            critic_data = {k: data[k] for k in ("returns", "old_values", "adv_loss_mask")}
            critic_stats = self.critic.train_batch(
                samples, critic_token_loss(self.value_eps_clip), critic_data)
            stats.update({k: v for k, v in critic_stats.items() if k.startswith("critic/")})
            stats["critic/grad_norm"] = critic_stats.get("train/grad_norm", 0.0)
        stats["ppo/minibatches"] = float(len(per_mb))
        return stats
