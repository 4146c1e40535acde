"""The experts a mixture-of-experts model chose for each token it read: what rollout routing replay
(R3) hands from the engine to the trainer.

A route table is an int16 array [tokens, sparse layers, top_k]: row t holds, for every sparse
layer in order, the experts that layer routed token t to when the engine read it (as an input: a
prompt token in a prefill, a generated token in the decode step after it was drawn). A row the
engine never read (the last generated token) or could not record is `UNROUTED` (-1): the trainer
routes it live. When a sequence is computed again (its cache recomputed after a weight update),
the new routes replace the old ones: the table holds the routing its later tokens were drawn
under.
"""

from __future__ import annotations

import numpy as np

UNROUTED = -1
DTYPE = np.int16  # expert ids (< 32768 experts per layer)


def unrouted(tokens: int, layers: int, top_k: int) -> np.ndarray:
    return np.full((tokens, layers, top_k), UNROUTED, dtype=DTYPE)


class RouteRecord:
    """One sequence's growing route table (amortised appends)."""

    def __init__(self, layers: int, top_k: int) -> None:
        self.table = unrouted(16, layers, top_k)
        self.length = 0

    def write(self, start: int, rows: np.ndarray) -> None:
        """Rows [m, layers, top_k] for tokens start .. start + m - 1."""
        end = start + rows.shape[0]
        if end > self.table.shape[0]:
            grown = unrouted(max(end, 2 * self.table.shape[0]), *self.table.shape[1:])
            grown[:self.length] = self.table[:self.length]
            self.table = grown
        self.table[start:end] = rows
        self.length = max(self.length, end)

    def routes(self, tokens: int) -> np.ndarray:
        """The table of the first `tokens` tokens (UNROUTED where never written)."""
        out = unrouted(tokens, *self.table.shape[1:])
        n = min(tokens, self.length)
        out[:n] = self.table[:n]
        return out


def fit(routes: np.ndarray | None, tokens: int) -> np.ndarray | None:
    """A response's routes for a sample of `tokens` tokens that starts with the response's input
    and output (a multi-turn episode's last response reads the whole conversation before it):
    the rows past the response UNROUTED. None stays None."""
    if routes is None:
        return None
    if len(routes) >= tokens:
        return routes[:tokens]
    out = unrouted(tokens, *routes.shape[1:])
    out[:len(routes)] = routes
    return out
