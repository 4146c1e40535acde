"""How far the sampler's logprobs are from the trainer's, per step (the mismatch monitor).

Engines and trainers compute the same policy with different kernels, batch shapes and precision;
when the two drift apart the importance weights explode and runs collapse (peers' users report
it). Each step the PPO actor feeds the monitor the trainer's logprobs of the batch under the
weights the step started from, before any update:

- `mismatch/logprob_diff_{mean,p99,max}`: |trainer - sampler| logprob on trained tokens the
  sampler generated with those same weights (version == the batch's policy version), so
  staleness does not enter; `mismatch/fresh_tokens` counts them (0: no fresh token this step,
  e.g. every token is stale at eta > 0, and the diff metrics are absent).
- `mismatch/iw_{p99,max,min}` and `mismatch/iw_over_2_frac`: the tails of the behaviour importance
  weight w = pi_theta / pi_behav on all trained tokens, pi_theta being the trainer's policy the
  step starts from (staleness and mismatch together): the weight a decoupled loss with a
  recomputed proximal policy multiplies by before any correction bounds it, measured whatever
  the objective (naive PPO and the log-linear proximal policy included).
"""

from __future__ import annotations

import torch

from asyncrl.api.loss import LossInputs


class MismatchMonitor:
    def __init__(self) -> None:
        self._diffs: list[torch.Tensor] = []
        self._log_w: list[torch.Tensor] = []

    def add(self, logprobs: torch.Tensor, inputs: LossInputs) -> None:
        mask = inputs.loss_mask
        fresh = mask & (inputs.versions == inputs.policy_version)
        lp = logprobs.detach().float()
        self._diffs.append((lp - inputs.behaviour_logprobs)[fresh].abs().cpu())
        log_w = (lp - inputs.behaviour_logprobs)[mask]
        self._log_w.append(log_w.float().cpu())

    def summary(self) -> dict[str, float]:
        """The step's metrics; the monitor is empty again afterwards."""
        diffs = torch.cat(self._diffs) if self._diffs else torch.zeros(0)
        log_w = torch.cat(self._log_w) if self._log_w else torch.zeros(0)
        self._diffs, self._log_w = [], []
        out = {"mismatch/fresh_tokens": float(diffs.numel())}
        if diffs.numel():
            out.update({"mismatch/logprob_diff_mean": float(diffs.mean()),
                        "mismatch/logprob_diff_p99": float(torch.quantile(diffs, 0.99)),
                        "mismatch/logprob_diff_max": float(diffs.max())})
        if log_w.numel():
            w = log_w.exp()
            out.update({"mismatch/iw_p99": float(torch.quantile(w, 0.99)),
                        "mismatch/iw_max": float(w.max()), "mismatch/iw_min": float(w.min()),
                        "mismatch/iw_over_2_frac": float((w > 2).float().mean())})
        return out


def unreplayed_gap(logprobs: list[torch.Tensor], samples: list, version: int
                   ) -> dict[str, float]:
    """`moe/logprob_diff_unreplayed_{mean,max}`: |trainer - sampler| on the fresh trained tokens
    (as `mismatch/logprob_diff_*`) of the trainer's forward without routing replay, per-sample
    input-aligned `logprobs`."""
    diffs = []
    for lp, s in zip(logprobs, samples):
        fresh = torch.tensor([m == 1 and v == version for m, v in zip(s.loss_mask, s.versions)])
        diffs.append((lp.float() - torch.tensor(s.logprobs))[fresh].abs())
    d = torch.cat(diffs) if diffs else torch.zeros(0)
    if not d.numel():
        return {}
    return {"moe/logprob_diff_unreplayed_mean": float(d.mean()),
            "moe/logprob_diff_unreplayed_max": float(d.max())}


def unreplayed_tokens(samples: list) -> int:
    """Tokens a replayed forward routed live for want of the engine's routes (a sample's last
    token is never read by the engine, nor needed: no trained token is predicted from it)."""
    from asyncrl.models.routes import UNROUTED

    count = 0
    for s in samples:
        if s.routes is None:
            count += len(s.input_ids) - 1
        else:
            count += int((s.routes[:-1, 0, 0] == UNROUTED).sum())
    return count
