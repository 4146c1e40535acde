"""Per-token log-probabilities of given labels under a model's logits.

The one place that decides how temperature enters: logprob = log_softmax(logits / T)[label], the
same convention the inference engine uses when it reports the behaviour policy's logprobs, so the
importance ratio of an unchanged policy is exactly 1.
"""

from __future__ import annotations

import torch


def gather_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """logits [..., V], labels [...] -> logprobs [...] in float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - logz
