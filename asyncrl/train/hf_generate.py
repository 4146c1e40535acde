"""Batched greedy generation through transformers' `generate`.

Used where the built-in engine is not wanted (a model it cannot run) and as the peer baseline in
benchmarks. Prompts are left-padded so every sequence's new tokens start at the same column.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.api.images import ImageInputs


@torch.inference_mode()
def hf_greedy_generate(
    model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos_id: int | None,
    batch_size: int = 128, images: Sequence[ImageInputs | None] | None = None,
) -> list[list[int]]:
    """Greedy continuations of `prompts` (token ids), each cut after its first EOS; `images`:
    each prompt's images, for a vision-language model (models/vision.py's encoder made both)."""
    outputs: list[list[int]] = []
    device = next(model.parameters()).device
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        ids, attn = ids.to(device), attn.to(device)
        inputs = {"input_ids": ids}
        if images is not None:
            from asyncrl.models.vision import vlm_forward_kwargs

            pictures = [x for x in images[start:start + batch_size] if x is not None]
            inputs = vlm_forward_kwargs(model, ids, attn.bool(), pictures)
        gen = model.generate(
            **inputs, attention_mask=attn, do_sample=False,
            max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id,
        )
        for row in gen[:, width:].tolist():
            if eos_id is not None and eos_id in row:
                row = row[: row.index(eos_id) + 1]
            else:
                row = [t for t in row if t != pad_id]
            outputs.append(row)
    return outputs
