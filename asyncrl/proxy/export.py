"""A finished session as training samples: `individual` or `concat` (pure functions).

- individual: every completion is one sample (its prompt ids + output ids), reward = its return.
- concat: the conversation tree (a completion's parent is the one whose prompt + output its prompt
  continues, see prompt_reuse) is exported leaf by leaf: one sample per leaf holding the whole
  conversation, loss mask 1 on every completion's output tokens along the path (with their
  logprobs and versions), 0 on prompts, tool results and template text. The sample's reward is the
  return of the path's first completion; `token_rewards` holds each turn's own reward on its last
  token, for critics that want turn-level credit.
"""

from __future__ import annotations

from typing import Literal

from asyncrl.api import PROMPT_VERSION, Sample
from asyncrl.proxy.records import Completion

ExportStyle = Literal["individual", "concat"]


def export_individual(completions: list[Completion], returns: dict[str, float]) -> list[Sample]:
    return [c.sample(returns[c.id]) for c in completions]


def export_concat(completions: list[Completion], raw: dict[str, float],
                  returns: dict[str, float]) -> list[Sample]:
    by_id = {c.id: c for c in completions}
    parents = {c.parent for c in completions if c.parent in by_id}
    samples = []
    for leaf in completions:
        if leaf.id in parents:
            continue
        path = [leaf]
        while path[-1].parent in by_id:
            path.append(by_id[path[-1].parent])
        path.reverse()
        ids = leaf.prompt_ids + leaf.output_ids
        n = len(ids)
        mask, logps, vers, token_rewards = [0] * n, [0.0] * n, [PROMPT_VERSION] * n, [0.0] * n
        for c in path:
            start = len(c.prompt_ids)
            if ids[start:start + len(c.output_ids)] != c.output_ids:
                raise ValueError(f"completion {c.id} is not a prefix of {leaf.id}'s tokens")
            end = start + len(c.output_ids)
            mask[start:end] = [1] * len(c.output_ids)
            logps[start:end] = c.logprobs
            vers[start:end] = c.versions
            if end > start:
                token_rewards[end - 1] = raw[c.id]
        samples.append(Sample(ids, mask, logps, vers, reward=returns[path[0].id],
                              token_rewards=token_rewards, stop_reason=leaf.stop_reason,
                              images=leaf.images, routes=leaf.routes,
                              metadata={"completion_ids": [c.id for c in path],
                                        "turns": len(path),
                                        "tool_calls": sum(c.tool_calls for c in path)}))
    return samples


def export_session(completions: list[Completion], raw: dict[str, float],
                   returns: dict[str, float], style: ExportStyle) -> list[Sample]:
    if style == "individual":
        return export_individual(completions, returns)
    if style == "concat":
        return export_concat(completions, raw, returns)
    raise ValueError(f"export_style={style!r} is not supported; allowed: individual, concat")
