"""Rollout routing replay (R3) in the trainer's forward, and the route monitor.

A mixture-of-experts layer picks its top-k experts from its router's probabilities. The engine and
the trainer compute those probabilities with different kernels, so near a tie they pick different
experts for the same token, and the flips compound across layers: the trainer then scores the
sampled tokens under a policy the engine never ran. R3 (arXiv 2510.11370) replays the engine's
choice: the trainer routes each token to the experts the engine recorded for it
(models/routes.py) and weights them with its own router's probabilities of those experts
(softmax over every expert, renormalised over the chosen ones where the model does), so the
router still gets gradients.

`RouteReplay` hooks the output of every router of a transformers (>= 5) mixture-of-experts model
(`*TopKRouter`: Qwen3-MoE, Mixtral, ...). For each forward `use` gives the routes of its input
rows ([rows, sparse layers, top_k], rows in the order the model flattens its input; UNROUTED
rows route live). In `Mode.REPLAY` the hooks return the recorded experts; in `Mode.OBSERVE` they
leave the live routing alone and count the rows whose top-k set differs from the recorded one
(the route-flip share the monitor reports), apart for the rows of fresh samples (recorded under
the weights the trainer holds: only arithmetic flips them) and stale ones (recorded under older
weights: the update flips them too). The engine reads a sequence's every row again after a
weight update, so a sample's routes were all recorded at the version of its last sampled token.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from asyncrl.models.routes import UNROUTED


class Mode(str, enum.Enum):
    REPLAY = "replay"  # route to the recorded experts
    OBSERVE = "observe"  # route live; count flips against the recorded experts


def sparse_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of a transformers mixture-of-experts model, in layer order (empty for a
    dense model)."""
    return [m for _, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]


class RouteReplay:
    """Hooks on `model`'s routers (see the module docstring). `take_metrics` returns the counts
    since the last call."""

    def __init__(self, model: torch.nn.Module, mode: Mode) -> None:
        self.routers = sparse_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router to replay "
                             "routes through (a *TopKRouter module: transformers >= 5's "
                             "Qwen3-MoE, Mixtral, ...)")
        self.mode = mode
        self._routes: torch.Tensor | None = None
        self._fresh: torch.Tensor | None = None
        self._counts = _zero_counts()
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(partial(self._hook, layer))

    def use(self, routes: torch.Tensor | None, fresh: torch.Tensor | None = None) -> None:
        """The routes of the next forwards' input rows (None: route live) and which rows are
        fresh ([rows] bool; None: all); they stay set until the next call, so a recomputation in
        backward (activation checkpointing) replays too."""
        if routes is not None and routes.shape[1] != len(self.routers):
            raise ValueError(f"routes of {routes.shape[1]} sparse layers for a model with "
                             f"{len(self.routers)}")
        self._routes, self._fresh = routes, fresh

    @contextlib.contextmanager
    def observing(self) -> Iterator[None]:
        """Route live inside (the monitor's forward without replay), counting flips."""
        mode, self.mode = self.mode, Mode.OBSERVE
        try:
            yield
        finally:
            self.mode = mode

    def _hook(self, layer: int, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self._routes is None:
            return None
        logits, scores, live = output
        recorded = self._routes[:, layer].to(live.device)
        if recorded.shape[0] != live.shape[0]:
            raise RuntimeError(f"routes for {recorded.shape[0]} rows; the router of sparse layer "
                               f"{layer} routes {live.shape[0]}")
        known = recorded[:, 0] != UNROUTED
        if self.mode == Mode.OBSERVE:  # (a recomputation in backward counts both again)
            flipped = (recorded.sort(-1).values != live.sort(-1).values).any(-1)
            fresh = (torch.ones_like(known) if self._fresh is None
                     else self._fresh.to(known.device))
            for kind, rows in (("fresh", known & fresh), ("stale", known & ~fresh)):
                self._counts[kind]["rows"] += int(rows.sum())
                self._counts[kind]["flipped"] += int((flipped & rows).sum())
            return None
        chosen = torch.where(known[:, None], recorded, live)
        weights = logits.float().softmax(-1).gather(1, chosen)
        if getattr(module, "norm_topk_prob", True):  # Mixtral always renormalises
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(scores.dtype), chosen

    def take_metrics(self) -> dict[str, float]:
        """`moe/route_flip_frac`: the share of fresh samples' (token, sparse layer) routings whose
        top-k set the trainer, routing freely, picks differently from the engine (observed
        forwards); `moe/route_flip_frac_stale` the same for stale samples."""
        counts, self._counts = self._counts, _zero_counts()
        names = {"fresh": "moe/route_flip_frac", "stale": "moe/route_flip_frac_stale"}
        return {names[kind]: c["flipped"] / c["rows"] for kind, c in counts.items() if c["rows"]}


def _zero_counts() -> dict[str, dict[str, int]]:
    return {"fresh": {"rows": 0, "flipped": 0}, "stale": {"rows": 0, "flipped": 0}}


def fresh_rows(versions: torch.Tensor, seq_id: torch.Tensor, version: int) -> torch.Tensor:
    """Per packed token [N]: whether its sample's routes were recorded at `version` (the
    sample's last sampled token's version, `versions` [N] and `seq_id` [N] as packed)."""
    latest = torch.full((int(seq_id.max()) + 1,), -1, dtype=versions.dtype, device=versions.device)
    latest = latest.scatter_reduce(0, seq_id, versions, reduce="amax")
    return latest[seq_id] == version


def padded_routes(routes: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """A packed micro-batch's per-token routes [N, layers, k] (or any [N, ...] row data) laid out
    as its padded rows' [rows, ...] (`index`: padded_layout's; padding rows route live)."""
    out = routes.new_full((rows, *routes.shape[1:]), UNROUTED)
    out[index] = routes
    return out
