"""Turns a batch of last-position logits into next tokens and the logprobs RL trains on.

Logprob convention (AReaL / verl): the reported logprob of a token is
`log_softmax(logits / temperature)[token]` over the full vocabulary, the number a trainer computes
when it divides its logits by the same temperature. Everything that only decides *which* token is
drawn leaves it unchanged: top-k and top-p truncation and the suppression of stop tokens before
`min_new_tokens`. Greedy requests report temperature-1 logprobs of the argmax token.

Sampling draws by the Gumbel-max trick (argmax of log p + Gumbel noise, i.e. the exponential race
in log space): equal to a multinomial draw, batched, and cheaper than `torch.multinomial`. Requests
with a seed draw their noise row from their own `torch.Generator`, so their output does not depend
on what else is in the batch; the rest share the engine's generator in one call.

Everything runs on the logits' device (the engine's): the generators live there too (a CUDA
generator draws a different stream than a CPU one for the same seed), and one device-to-host
copy per step returns the tokens and logprobs together (`draw` leaves them on the device, for an
overlapped step that reads them one step later).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.inference.scheduler import Sequence


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]


class Sampler:
    def __init__(
        self, eos_token_ids: list[int], seed: int = 0, device: torch.device | str = "cpu"
    ) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def stop_ids(self, seq: Sequence) -> list[int]:
        return [*self.eos_token_ids, *seq.gconfig.stop_token_ids]

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleOutput:
        """logits [n, V] fp32 for `seqs` in order -> one token and its logprob per sequence."""
        return self.to_host(*self.draw(logits, seqs))

    @staticmethod
    def to_host(tokens: torch.Tensor, chosen: torch.Tensor) -> SampleOutput:
        """`draw`'s device tensors as lists. One transfer (one sync on CUDA) for both; float64
        holds token ids (< 2^53) and the fp32 logprobs exactly, so the values are those of two
        separate `.tolist()` calls."""
        both = torch.stack((tokens.double(), chosen.double())).tolist()
        return SampleOutput([int(t) for t in both[0]], both[1])

    @torch.inference_mode()
    def draw(self, logits: torch.Tensor, seqs: list[Sequence], pending: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [n] and their logprobs [n], on the device (nothing read back). `pending`:
        tokens each sequence has drawn that it does not hold yet (an overlapped step's)."""
        gcs = [s.gconfig for s in seqs]
        dev = logits.device
        greedy = [g.greedy for g in gcs]
        temps = [1.0 if g.greedy else g.temperature for g in gcs]
        if any(t != 1.0 for t in temps):
            logits = logits / torch.tensor(temps, dtype=logits.dtype, device=dev)[:, None]
        logprobs = torch.log_softmax(logits, -1)
        filtered = self._truncate(self._suppress_stops(logprobs, seqs, pending), gcs)
        if all(greedy):
            tokens = filtered.argmax(-1)
        else:
            tokens = self._race(filtered, seqs).argmax(-1)
            if any(greedy):
                is_greedy = torch.tensor(greedy, device=dev)
                tokens = torch.where(is_greedy, filtered.argmax(-1), tokens)
        return tokens, logprobs.gather(1, tokens[:, None])[:, 0]

    def _suppress_stops(self, logprobs: torch.Tensor, seqs: list[Sequence], pending: int = 0
                        ) -> torch.Tensor:
        """Stop tokens cannot be drawn before min_new_tokens (logprobs are reported unmasked)."""
        rows, cols = [], []
        for i, s in enumerate(seqs):
            if s.num_outputs + pending < s.gconfig.min_new_tokens:
                ids = self.stop_ids(s)
                rows += [i] * len(ids)
                cols += ids
        if not rows:
            return logprobs
        out = logprobs.clone()
        index = torch.tensor([rows, cols], device=logprobs.device)
        out[index[0], index[1]] = float("-inf")
        return out

    @staticmethod
    def _truncate(logprobs: torch.Tensor, gcs) -> torch.Tensor:
        """Top-k then top-p (HF order) as -inf outside the kept set; rows without either pass."""
        vocab = logprobs.shape[-1]
        top_k = [g.top_k if 0 < g.top_k < vocab else vocab for g in gcs]
        top_p = [g.top_p for g in gcs]
        if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
            return logprobs
        dev = logprobs.device
        sorted_lp, order = logprobs.sort(-1, descending=True)
        rank = torch.arange(vocab, device=dev)
        drop = rank[None, :] >= torch.tensor(top_k, device=dev)[:, None]
        sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
        probs = sorted_lp.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it
        # already does (the first token is always kept).
        before = probs.cumsum(-1) - probs
        # top_p == 1 must keep everything even when rounding pushes the cumsum past 1.
        limit = torch.tensor(
            [p if p < 1.0 else float("inf") for p in top_p], dtype=probs.dtype, device=dev
        )
        drop |= before >= limit[:, None]
        drop[:, 0] = False
        keep = torch.zeros_like(drop).scatter_(1, order, ~drop)
        return logprobs.masked_fill(~keep, float("-inf"))

    def _race(self, logprobs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Scores whose argmax is a sample: log p + Gumbel noise, i.e. log(p / E), E ~ Exp(1)."""
        u = torch.rand(
            logprobs.shape, generator=self.generator, dtype=logprobs.dtype, device=self.device
        )
        for i, s in enumerate(seqs):
            if s.gconfig.seed is None:
                continue
            if s.sampler_state is None:
                s.sampler_state = torch.Generator(self.device).manual_seed(s.gconfig.seed)
            u[i].uniform_(generator=s.sampler_state)
        # u = 0 gives -inf noise (never drawn, probability 2^-24); u < 1 always, so no +inf and
        # a filtered -inf logprob can never win or turn into NaN.
        return logprobs - u.log_().neg_().log_()
