"""A model's shape, read from its config.json: what a server must share with the trainer for a
weight push to fit (the startup model check of remote servers).

`shape_mismatch(served, expected)` compares two model directories' architectures (model type,
vocabulary, widths, depth, heads; a vision-language model's language side and vision tower) and
says how they differ, or None when they agree. Weights, the output head's tying and the context
window may differ: the first push replaces the weights, and the weight canary checks them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_TEXT_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "intermediate_size")
_VISION_FIELDS = ("depth", "embed_dim", "hidden_size", "patch_size", "spatial_merge_size")


def model_shape(model_dir: str | Path) -> dict[str, Any] | None:
    """The architecture fields of `model_dir`'s config.json; None where it has none here."""
    cfg_file = Path(model_dir) / "config.json"
    if not cfg_file.is_file():
        return None
    cfg = json.loads(cfg_file.read_text())
    text = {**cfg, **cfg.get("text_config", {})}  # a VLM's language side lives in text_config
    shape = {k: text[k] for k in _TEXT_FIELDS if k in text}
    shape["model_type"] = cfg.get("model_type", shape.get("model_type"))
    vision = cfg.get("vision_config") or {}
    shape.update({f"vision.{k}": vision[k] for k in _VISION_FIELDS if k in vision})
    return shape


def shape_mismatch(served: str | Path, expected: str | Path) -> str | None:
    """How the model at `served` differs from the one at `expected` ("hidden_size 64 vs 128,
    ..."), or None when their shapes agree or either cannot be read here."""
    a, b = model_shape(served), model_shape(expected)
    if a is None or b is None:
        return None
    diffs = [f"{k} {a.get(k)} vs {b.get(k)}" for k in sorted(set(a) | set(b))
             if a.get(k) != b.get(k)]
    return ", ".join(diffs) or None
