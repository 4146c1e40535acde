"""Discounted returns from per-turn rewards (pure functions), for workflows and proxy sessions.

One recursion, `turn_returns`: G_t = r_t + discount * G_(t+1), where a turn may hold several
choices (the `n` choices of one proxy request) and G_(t+1) is the mean return of the next turn's
choices. A workflow with one reply per turn (multi-turn answering, agent + environment steps) is
the special case `discounted_returns`.

Proxy sessions (`raw_rewards`, `session_returns`): turns are the session's requests in order, each
a list of completion ids. A float reward belongs to the last turn's choices; a dict gives each
named completion its own; every other completion starts at 0 before discounting.
"""

from __future__ import annotations

from collections.abc import Sequence


def turn_returns(turn_rewards: Sequence[Sequence[float]], discount: float) -> list[list[float]]:
    """Each choice's return: its reward + discount * the mean return of the next turn's choices.

    A turn without choices passes the following turn's mean on unchanged. Callers validate
    `discount` (their configs bound it to [0, 1]).
    """
    out: list[list[float]] = [[] for _ in turn_rewards]
    after = 0.0  # mean return of the following turn
    for t in reversed(range(len(turn_rewards))):
        out[t] = [r + discount * after for r in turn_rewards[t]]
        if out[t]:
            after = sum(out[t]) / len(out[t])
    return out


def discounted_returns(rewards: Sequence[float], discount: float) -> list[float]:
    """One reply per turn: G_t = r_t + discount * G_(t+1) for each turn's reward r_t."""
    return [g for (g,) in turn_returns([[r] for r in rewards], discount)]


def raw_rewards(turns: list[list[str]], named: dict[str, float],
                last: float | None) -> dict[str, float]:
    """Each completion's own reward: named ones, the float on the last turn, 0 elsewhere."""
    out = {cid: 0.0 for turn in turns for cid in turn}
    if last is not None and turns:
        for cid in turns[-1]:
            out[cid] = last
    for cid, value in named.items():
        if cid not in out:
            raise KeyError(f"reward names completion {cid!r}, which is not in the session")
        out[cid] = value
    return out


def session_returns(turns: list[list[str]], rewards: dict[str, float],
                    discount: float) -> dict[str, float]:
    """Each completion id's discounted return, from `raw_rewards` and the session's turn_discount."""
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"turn_discount={discount} is out of range; allowed [0, 1]")
    returns = turn_returns([[rewards[cid] for cid in turn] for turn in turns], discount)
    return {cid: g for turn, gs in zip(turns, returns) for cid, g in zip(turn, gs)}
