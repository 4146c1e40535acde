"""The spellings of a weight's name between memory and disk.

A vision-language model: transformers 5 names its weights in memory "model.language_model.*"
(the decoder) and "model.visual.*" (the vision tower), while checkpoints on disk (Qwen2-VL /
Qwen2.5-VL as published, and transformers' own save_pretrained) write "model.*" and "visual.*";
older exports wrote the decoder as "language_model.model.*".

A mixture-of-experts model: checkpoints on disk (and transformers 4 in memory) name one matrix per
expert ("mlp.experts.{e}.gate_proj.weight"; Mixtral "block_sparse_moe.experts.{e}.w1.weight",
w3 the up and w2 the down projection), transformers 5 holds each layer's experts as two stacked
tensors ("mlp.experts.gate_up_proj" [E, 2 * I, D], gate first, and "mlp.experts.down_proj"
[E, D, I]); `expert_weights` reads either as the per-expert names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

VISION_PREFIXES = ("model.visual.", "visual.")
LANGUAGE_PREFIXES = ("model.language_model.", "language_model.model.")


def split_vlm_name(name: str) -> tuple[str, str]:
    """("vision", the name inside the vision module) or ("language", the decoder's name as a
    causal LM spells it: "model.layers...", "lm_head.weight")."""
    for prefix in VISION_PREFIXES:
        if name.startswith(prefix):
            return "vision", name[len(prefix):]
    for prefix in LANGUAGE_PREFIXES:
        if name.startswith(prefix):
            return "language", "model." + name[len(prefix):]
    return "language", name


def spellings(name: str) -> list[str]:
    """Every name this weight may have in a checkpoint, `name` first."""
    part, inner = split_vlm_name(name)
    if part == "vision":
        names = [p + inner for p in VISION_PREFIXES]
    elif inner.startswith("model."):
        rest = inner[len("model."):]
        names = [inner, *(p + rest for p in LANGUAGE_PREFIXES)]
    else:
        names = [inner]
    return [name, *(n for n in names if n != name)]


_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.weight$")
_MIXTRAL_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def expert_weights(items: Iterable[tuple[str, Any]], intermediate_size: int
                   ) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs with every expert weight under its per-expert name
    "model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight" (stacked tensors split into
    views per expert; `intermediate_size`: each expert's) and the router as "mlp.gate.weight";
    other weights pass through."""
    for name, tensor in items:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _MIXTRAL_EXPERT.search(name)
        if m:
            name = f"{name[:m.start()]}.experts.{m[1]}.{_MIXTRAL_PROJ[m[2]]}.weight"
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[:-len("gate_up_proj")]
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", tensor[e, :intermediate_size]
                yield f"{prefix}{e}.up_proj.weight", tensor[e, intermediate_size:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[:-len("down_proj")]
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor
