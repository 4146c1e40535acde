"""Numbers about rollouts for the logs: every finished episode (before filtering) and each batch.

A `RolloutMonitor` is the job's acceptance rule (called on every finished trajectory on the
executor's thread; `rejection` says, in the user's settings' names, why one was dropped);
`take()` returns and resets what accumulated since the previous call (the kept share and the
mean reward only when an episode finished in it).
`batch_metrics` describes the batch the trainer consumed (staleness = consuming version minus the
version the episode started under; token lag = consuming version minus each token's version).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from asyncrl.api import Trajectory


def uniform_rewards(traj: Trajectory) -> bool:
    rewards = traj.rewards
    return len(rewards) > 0 and max(rewards) == min(rewards)


class RolloutMonitor:
    setting = "filter_uniform_groups"  # what the executor's rejection messages name

    def __init__(self, drop_uniform_groups: bool) -> None:
        self.drop_uniform = drop_uniform_groups
        self._lock = threading.Lock()
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self._since = now
        self._episodes = self._samples = self._tokens = self._kept = 0
        self._reward_sum = 0.0
        self._tool_samples = self._agent_samples = 0  # agent workflows: samples with tool calls

    def rejection(self, traj: Trajectory) -> str:
        """Why `accept` dropped `traj`, naming the setting that did."""
        return (f"filter_uniform_groups dropped a group whose {len(traj.rewards)} rewards "
                f"were all {traj.rewards[0]:g} (no signal to learn from; set "
                "filter_uniform_groups=false to train on such groups)")

    def __call__(self, traj: Trajectory) -> bool:
        return self.accept(traj)

    def accept(self, traj: Trajectory) -> bool:
        keep = not (self.drop_uniform and uniform_rewards(traj))
        with self._lock:
            self._episodes += 1
            self._kept += keep
            self._samples += len(traj.samples)
            self._reward_sum += sum(traj.rewards)
            self._tokens += sum(s.num_generated for s in traj.samples)
            agent = [s for s in traj.samples if "tool_calls" in s.metadata]
            self._agent_samples += len(agent)
            self._tool_samples += sum(s.metadata["tool_calls"] > 0 for s in agent)
        return keep

    def take(self) -> dict[str, float]:
        now = time.perf_counter()
        with self._lock:
            dt = max(now - self._since, 1e-9)
            out = {
                "rollout/episodes": float(self._episodes),
                "perf/gen_tokens_per_s": self._tokens / dt,
                "perf/gen_samples_per_s": self._samples / dt,
            }
            if self._episodes:  # no episode finished: no share or mean to report (not a 0)
                out["rollout/kept_frac"] = self._kept / self._episodes
            if self._samples:
                out["reward/all_mean"] = self._reward_sum / self._samples
            if self._agent_samples:  # with export_style concat: episodes that called a tool
                out["agent/tool_call_frac"] = self._tool_samples / self._agent_samples
            self._reset(now)
        return out


def batch_metrics(trajs: Sequence[Trajectory], version: int) -> dict[str, float]:
    samples = [s for t in trajs for s in t.samples]
    stale = [version - t.metadata.get("start_version", version) for t in trajs]
    token_lag = [version - v for s in samples for v, m in zip(s.versions, s.loss_mask) if m]
    rewards = [s.reward for s in samples]
    generated = [s.num_generated for s in samples]
    hist = {f"staleness/hist_{lag}": sum(x == lag for x in stale) / len(stale)
            for lag in range(max(stale) + 1)}
    return {
        **hist,  # this batch's trajectories by staleness (versions behind at consumption)
        "reward/mean": sum(rewards) / len(rewards),
        "reward/max": max(rewards),
        "reward/min": min(rewards),
        "staleness/mean": sum(stale) / len(stale),
        "staleness/max": float(max(stale)),
        "staleness/token_lag_max": float(max(token_lag, default=0)),
        "staleness/mixed_version_frac": sum(s.head_version != s.tail_version for s in samples)
        / len(samples),
        "batch/trajectories": float(len(trajs)),
        "batch/samples": float(len(samples)),
        "batch/tokens": float(sum(len(s.input_ids) for s in samples)),
        "batch/gen_len_mean": sum(generated) / len(generated),
        # completions cut by max_new_tokens (or the context window), not ended by the model
        "batch/truncated_frac": sum(s.truncated for s in samples) / len(samples),
    }
