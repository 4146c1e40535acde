"""The spellings of one vision-language model's weight names: transformers 5 names them in memory
"model.language_model.*" (the decoder) and "model.visual.*" (the vision tower), while checkpoints
on disk (Qwen2-VL / Qwen2.5-VL as published, and transformers' own save_pretrained) write
"model.*" and "visual.*"; older exports wrote the decoder as "language_model.model.*"."""

from __future__ import annotations

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
