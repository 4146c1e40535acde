"""Per-completion rewards of a session: raw rewards in, discounted returns out (pure functions).

Turns are the session's requests in order (the `n` choices of one request form one turn). A float
reward belongs to the last turn's choices; a dict gives each named completion its own. Earlier
turns then receive the discounted return G_t = r_t + turn_discount * G_(t+1), where G_(t+1) is the
mean return of the next turn's choices (one choice in the usual agent loop, so G_t = r_t + g G_t+1).
"""

from __future__ import annotations


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


def discounted_returns(turns: list[list[str]], rewards: dict[str, float],
                       discount: float) -> dict[str, float]:
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"turn_discount={discount} is out of range; allowed [0, 1]")
    out: dict[str, float] = {}
    after = 0.0  # mean return of the following turn
    for turn in reversed(turns):
        for cid in turn:
            out[cid] = rewards[cid] + discount * after
        after = sum(out[cid] for cid in turn) / len(turn) if turn else after
    return out
