"""An endless, resumable stream of training rows: a fresh seeded shuffle every epoch.

`position` counts rows handed out; a checkpoint keeps it (`state_dict`), and a stream with the same
rows and seed continues exactly where the saved one stopped (the executor pulls rows ahead of
training, and the rows queued or in flight at a checkpoint are kept with the episodes, so none is
repeated or lost).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any


class DataStream:
    def __init__(self, rows: Sequence[dict[str, Any]], seed: int = 0) -> None:
        if not rows:
            raise ValueError("the training split is empty; the stream needs at least one row")
        self.rows, self.seed = list(rows), seed
        self.position = 0
        self._epoch, self._order = -1, []

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["position"] < 0:
            raise ValueError(f"position={state['position']} is out of range; allowed [0, inf)")
        self.position = state["position"]

    @property
    def epoch(self) -> int:
        return self.position // len(self.rows)

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._order = list(range(len(self.rows)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._epoch = epoch
        return self._order

    def __iter__(self) -> DataStream:
        return self

    def __next__(self) -> dict[str, Any]:
        epoch, index = divmod(self.position, len(self.rows))
        row = self.rows[self._order_for(epoch)[index]]
        self.position += 1
        return row
