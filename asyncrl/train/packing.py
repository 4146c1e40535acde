"""Sequence packing: samples -> padding-free micro-batches under a token budget.

A micro-batch is the concatenation of whole samples into one row [1, N] with `position_ids`
restarting at 0 for each sample. transformers builds a block-diagonal causal mask from restarting
position ids when no attention mask and no KV cache are given (sdpa/eager on CPU; flash-attention
derives `cu_seqlens` from the same ids on GPU), so no token attends across a sample boundary and
no FLOPs go to padding. Per-token tensors here use the *input-aligned* convention of `Sample`:
index t describes token t (its loss_mask, its behaviour logprob), and the model's logprob of token
t comes from the logits at t - 1; the first token of every sample has no prediction (logprob 0,
loss_mask forced to 0), so nothing is ever predicted across a boundary.

Samples are assigned to micro-batches longest first (first-fit decreasing for the count, then
least-loaded placement for balance) and each micro-batch records which sample and which slice
each token came from, so per-token outputs scatter back to samples.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from asyncrl.api.images import ImageInputs
from asyncrl.api.trajectory import Sample
from asyncrl.models.routes import UNROUTED


@dataclass
class PackedMicroBatch:
    """Samples concatenated into one row; `tensors` holds input-aligned per-token fields [N]."""

    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N]
    cu_seqlens: torch.Tensor  # [k + 1] int32 offsets of the k samples in the row
    sample_index: list[int]  # position in the caller's list of each packed sample
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # each packed sample's images (None: text only), in packing order
    images: list[ImageInputs | None] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def has_images(self) -> bool:
        return any(x is not None for x in self.images)

    # the fields every micro-batch has (see `pack_samples`); callers' own fields are in `tensors`
    loss_mask = property(lambda self: self.tensors["loss_mask"])
    behaviour_logprobs = property(lambda self: self.tensors["behaviour_logprobs"])
    versions = property(lambda self: self.tensors["versions"])
    seq_id = property(lambda self: self.tensors["seq_id"])

    @property
    def seq_starts(self) -> torch.Tensor:
        """Bool [N]: True at the first token of each sample."""
        starts = torch.zeros(self.num_tokens, dtype=torch.bool)
        starts[self.cu_seqlens[:-1].long()] = True
        return starts

    def to(self, device: torch.device | str) -> PackedMicroBatch:
        return PackedMicroBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.cu_seqlens.to(device),
            list(self.sample_index),
            {k: v.to(device) for k, v in self.tensors.items()},
            list(self.images),
        )


def _check_budget(max_tokens: int) -> None:
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_mb={max_tokens} is out of range; allowed [1, inf)")


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices grouped into bins of total length <= capacity, longest first.

    A single item longer than `capacity` gets a bin of its own: splitting a sequence would cut
    its attention context, so it is better to exceed the budget than to change the math.
    """
    _check_budget(capacity)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        slot = next((b for b, load in enumerate(loads) if load + lengths[i] <= capacity), None)
        if slot is None:
            bins.append([])
            loads.append(0)
            slot = len(bins) - 1
        bins[slot].append(i)
        loads[slot] += lengths[i]
    return bins


def balanced_partition(lengths: Sequence[int], num_parts: int) -> list[list[int]]:
    """Indices split into exactly `num_parts` groups of near-equal total length (LPT greedy).

    Used to give data-parallel ranks equal work and to spread a batch over a fixed number of
    micro-batches; groups may be empty when there are fewer items than parts.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts} is out of range; allowed [1, inf)")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    loads = [0] * num_parts
    for i in order:
        p = min(range(num_parts), key=lambda j: (loads[j], j))
        parts[p].append(i)
        loads[p] += lengths[i]
    return [sorted(p) for p in parts]


TokenData = Mapping[str, Sequence[torch.Tensor]]


def pack_samples(
    samples: Sequence[Sample],
    indices: Sequence[int],
    token_data: TokenData | None = None,
) -> PackedMicroBatch:
    """Pack `samples[i] for i in indices` into one row.

    `token_data` maps a name to one input-aligned tensor per sample in `samples` (advantages,
    proximal or reference logprobs, ...); it is packed alongside as float32 tensors [N].
    Always present: loss_mask [N] (bool; 0 at each sample's first token, which has no prefix to
    predict it from), behaviour_logprobs [N], versions [N] (long), seq_id [N] (long, 0..k-1
    within this micro-batch). When a sample carries routes: routes [N, sparse layers, top_k]
    (long; UNROUTED for the samples without).
    """
    if not indices:
        raise ValueError("pack_samples needs at least one sample index; got none")
    lengths = [len(samples[i].input_ids) for i in indices]
    for i, n in zip(indices, lengths):
        if n == 0:
            raise ValueError(f"samples[{i}] has no tokens; len(input_ids)=0, allowed [1, inf)")
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for i in indices:
        s = samples[i]
        ids += s.input_ids
        mask += s.loss_mask
        logprobs += s.logprobs
        versions += s.versions
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    starts = offsets[:-1].long()
    k = len(indices)
    tensors = {
        "loss_mask": torch.tensor(mask, dtype=torch.bool).index_fill_(0, starts, False),
        "behaviour_logprobs": torch.tensor(logprobs, dtype=torch.float32),
        "versions": torch.tensor(versions, dtype=torch.long),
        "seq_id": torch.repeat_interleave(torch.arange(k), torch.tensor(lengths)),
    }
    routed = [samples[i].routes for i in indices if samples[i].routes is not None]
    if routed:  # a mixture-of-experts policy's routes [N, layers, top_k] (-1: route live)
        tensors["routes"] = torch.cat([
            torch.from_numpy(samples[i].routes).long() if samples[i].routes is not None
            else torch.full((n, *routed[0].shape[1:]), UNROUTED, dtype=torch.long)
            for i, n in zip(indices, lengths)])
    for name, per_sample in (token_data or {}).items():
        for i, n in zip(indices, lengths):
            if per_sample[i].shape != (n,):
                raise ValueError(f"token_data[{name!r}][{i}] has shape "
                                 f"{tuple(per_sample[i].shape)}; must be ({n},), the length of "
                                 f"samples[{i}].input_ids")
        tensors[name] = torch.cat([per_sample[i] for i in indices]).float()
    position_ids = torch.arange(offsets[-1].item()) - torch.repeat_interleave(starts,
                                                                             torch.tensor(lengths))
    return PackedMicroBatch(
        input_ids=torch.tensor(ids, dtype=torch.long).unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=offsets,
        sample_index=list(indices),
        tensors=tensors,
        images=[samples[i].images for i in indices],
    )


def padded_layout(mb: PackedMicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed row as k right-padded rows: input_ids [k, L], attention_mask [k, L], and the
    flat index [N] of each packed token in the k * L grid (`out.flatten(0, 1)[index]` is [N]).

    For attention kernels that see a packed row as one dense N x N masked matrix (CPU SDPA, eager)
    this costs k * L^2 instead of N^2: on the main job's 128 x ~30-token samples 3,869 instead of
    2,561 tok/s (`benchmarks/bench_train.py --task grpo --layouts packed,padded`).
    """
    bounds = mb.cu_seqlens.long()
    lengths = bounds[1:] - bounds[:-1]
    k, width = len(lengths), int(lengths.max())
    device = mb.input_ids.device
    rows = torch.repeat_interleave(torch.arange(k, device=device), lengths)
    cols = torch.arange(mb.num_tokens, device=device) - torch.repeat_interleave(bounds[:-1], lengths)
    index = rows * width + cols
    ids = torch.zeros(k * width, dtype=mb.input_ids.dtype, device=device)
    ids[index] = mb.input_ids[0]
    mask = torch.zeros(k * width, dtype=torch.long, device=device)
    mask[index] = 1
    return ids.view(k, width), mask.view(k, width), index


def shared_prefix_len(loss_mask: Sequence[int | bool]) -> int:
    """Tokens before a sample's last untrained token ahead of its first trained one: the part
    that samples with the same prompt (a GRPO group) can compute once. The last prompt token
    stays with each sample, so the logits that predict the first trained token are its own."""
    first = next((t for t in range(1, len(loss_mask)) if loss_mask[t]), len(loss_mask))
    return max(first - 1, 0)


def prefix_units(samples: Sequence[Sample], indices: Sequence[int]) -> list[list[int]]:
    """`indices` grouped by identical shared prefix (first appearance order): the units a
    micro-batch plan keeps together so their prompt is computed once."""
    units: dict[tuple[int, ...], list[int]] = {}
    for i in indices:
        s = samples[i]
        # alone: no shared prefix, or images (a continuation's multimodal positions depend on
        # its prompt's image grids, which the KV-cache path does not carry)
        key = (tuple(s.input_ids[: shared_prefix_len(s.loss_mask)]) if s.images is None
               else ()) or (-1 - i,)
        units.setdefault(key, []).append(i)
    return list(units.values())


def unit_tokens(samples: Sequence[Sample], unit: Sequence[int]) -> int:
    """Tokens a unit costs when its shared prefix is computed once."""
    prefix = shared_prefix_len(samples[unit[0]].loss_mask) if len(unit) > 1 else 0
    return prefix + sum(len(samples[i].input_ids) - prefix for i in unit)


def plan_micro_batches(samples: Sequence[Sample], indices: Sequence[int], max_tokens: int,
                       share_prefixes: bool = False,
                       agree: Callable[[int], int] = lambda n: n) -> list[list[int]]:
    """`samples[i] for i in indices` as groups of indices, one per micro-batch: as few as the
    budget allows, balanced by tokens. With `share_prefixes`, samples with the same shared
    prefix (a GRPO group) stay together, so their prompt is computed once. `agree(count)` turns
    this rank's count into the one every rank runs (the max over data-parallel ranks, for
    lock-step collectives); a rank may then have empty groups."""
    units = prefix_units(samples, indices) if share_prefixes else [[i] for i in indices]
    costs = [unit_tokens(samples, u) for u in units]
    ffd = first_fit_decreasing(costs, max_tokens) if units else []
    count = max(1, agree(len(ffd)))
    parts = balanced_partition(costs, count)
    if count == len(ffd) and any(len(p) > 1 and sum(costs[u] for u in p) > max_tokens
                                 for p in parts):
        parts = [sorted(b) for b in ffd]  # least-loaded placement overflowed; FFD's bins fit
    return [[i for u in part for i in units[u]] for part in parts]


@dataclass
class SharedPrefixLayout:
    """A micro-batch as G distinct prefixes [G, P] plus k continuations [k, C] that attend to
    their prefix through a KV cache (`group` [k]: each row's prefix). `token_pos` [M] are the
    packed positions computed by the continuation pass, at `index` [M] of its k * C grid."""

    prefix_ids: torch.Tensor
    prefix_mask: torch.Tensor
    group: torch.Tensor
    cont_ids: torch.Tensor
    cont_mask: torch.Tensor  # [k, P + C]: the row's prefix, then its continuation
    cont_pos: torch.Tensor
    index: torch.Tensor
    token_pos: torch.Tensor

    @property
    def computed_tokens(self) -> int:
        """Positions its two forwards compute, padding included."""
        return self.prefix_ids.numel() + self.cont_ids.numel()


def shared_prefix_layout(mb: PackedMicroBatch) -> SharedPrefixLayout | None:
    """The layout computing each shared prefix once; None when no two samples share one, or
    when a sample has images (see `prefix_units`)."""
    if mb.has_images:
        return None
    ids = mb.input_ids[0].tolist()
    mask = mb.tensors["loss_mask"].tolist()
    bounds = mb.cu_seqlens.tolist()
    groups: dict[tuple[int, ...], int] = {}
    rows = []  # (start, prefix length, end, group)
    for start, end in zip(bounds[:-1], bounds[1:]):
        plen = shared_prefix_len(mask[start:end])
        g = groups.setdefault(tuple(ids[start:start + plen]), len(groups))
        rows.append((start, plen, end, g))
    sizes = collections.Counter(g for _, plen, _, g in rows if plen > 0)
    if not sizes or max(sizes.values()) < 2:
        return None
    width_p = max(r[1] for r in rows)
    width_c = max(end - start - plen for start, plen, end, _ in rows)
    k, device = len(rows), mb.input_ids.device
    prefix_ids = torch.zeros(len(groups), width_p, dtype=torch.long)
    prefix_mask = torch.zeros(len(groups), width_p, dtype=torch.long)
    for key, g in groups.items():
        prefix_ids[g, : len(key)] = torch.tensor(key, dtype=torch.long)
        prefix_mask[g, : len(key)] = 1
    cont_ids = torch.zeros(k, width_c, dtype=torch.long)
    cont_mask = torch.zeros(k, width_p + width_c, dtype=torch.long)
    cont_pos = torch.zeros(k, width_c, dtype=torch.long)
    index, token_pos = [], []
    for j, (start, plen, end, _) in enumerate(rows):
        n = end - start - plen
        cont_ids[j, :n] = torch.tensor(ids[start + plen:end], dtype=torch.long)
        cont_mask[j, :plen] = 1
        cont_mask[j, width_p:width_p + n] = 1
        cont_pos[j] = torch.arange(plen, plen + width_c)
        index += range(j * width_c, j * width_c + n)
        token_pos += range(start + plen, end)
    return SharedPrefixLayout(
        *(t.to(device) for t in (prefix_ids, prefix_mask,
                                 torch.tensor([r[3] for r in rows], dtype=torch.long), cont_ids,
                                 cont_mask, cont_pos, torch.tensor(index, dtype=torch.long),
                                 torch.tensor(token_pos, dtype=torch.long))))


def next_token_logprobs_aligned(
    token_logprobs_next: torch.Tensor, mb: PackedMicroBatch
) -> torch.Tensor:
    """[N] logprob of token t+1 at position t -> [N] input-aligned (logprob of token t at t).

    The shift moves each value one place right; sample starts get 0, which also discards the
    value that would have predicted a sample's first token from the previous sample's last.
    """
    aligned = torch.roll(token_logprobs_next, 1, dims=-1)
    starts = mb.seq_starts.to(aligned.device)
    return torch.where(starts, torch.zeros_like(aligned), aligned)


def unpack(values: torch.Tensor, mb: PackedMicroBatch) -> list[torch.Tensor]:
    """[N] per-token values -> one tensor per packed sample, in `mb.sample_index` order."""
    bounds = mb.cu_seqlens.tolist()
    return [values[bounds[j]:bounds[j + 1]] for j in range(len(mb.sample_index))]
