"""PEFT LoRA adapters as plain tensors: their names, the merge W = W0 + s * B @ A, their files.

An adapter travels from the trainer to the engines (in memory, in HTTP buckets, on disk) in
PEFT's own format, so any PEFT reader takes it: tensors named as `get_peft_model_state_dict`
names them (`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r])
and, on disk, `adapter_config.json` + `adapter_model.safetensors` (`PeftModel.save_pretrained`'s
layout, which `PeftModel.from_pretrained` and vLLM's LoRA loader read).

The built-in engine applies an adapter by merging it into a base copy of each adapted weight
(`AdapterMerger`): the merged weight computes exactly what PEFT's LoRA layer computes without
dropout, x @ W0^T + s * (x @ A^T) @ B^T, up to float rounding. Only plain LoRA on Linear layers
is understood; anything else in an adapter (DoRA magnitudes, embeddings, biases, modules_to_save,
per-module ranks) is refused by name rather than silently dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from asyncrl.models.weight_names import spellings

PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the HF model
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_A, _B = ".lora_A.weight", ".lora_B.weight"


def adapter_scale(config: Mapping[str, Any]) -> float:
    """PEFT's scaling of B @ A from an adapter config: alpha / r (alpha / sqrt(r) with rsLoRA)."""
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"adapter config {key}={config[key]!r} is not supported (one rank "
                             "and alpha for every module); allowed: empty")
    if config.get("use_dora"):
        raise ValueError("adapter config use_dora=True is not supported; allowed: false")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def adapted_weights(adapter: Mapping[str, torch.Tensor]
                    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF name of each adapted Linear weight -> (A [r, in], B [out, r])."""
    a_of: dict[str, torch.Tensor] = {}
    b_of: dict[str, torch.Tensor] = {}
    for name, tensor in adapter.items():
        module = name.removeprefix(PREFIX)
        if module.endswith(_A):
            a_of[module[: -len(_A)]] = tensor
        elif module.endswith(_B):
            b_of[module[: -len(_B)]] = tensor
        else:
            raise ValueError(f"adapter tensor {name!r} is not a LoRA A or B weight of a Linear "
                             f"layer (*{_A}, *{_B}); other adapter parts are not supported")
    unpaired = sorted(set(a_of) ^ set(b_of))
    if unpaired:
        raise ValueError(f"adapter has an A without its B (or a B without its A) for "
                         f"{unpaired[:3]}")
    return {f"{m}.weight": (a_of[m], b_of[m]) for m in sorted(a_of)}


def merge_adapter(base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor],
                  scale: float) -> dict[str, torch.Tensor]:
    """{HF weight name: W0 + scale * B @ A} for every weight the adapter adapts (fp32 math, the
    base's dtype out); `base` must hold those weights."""
    out = {}
    for name, (a, b) in adapted_weights(adapter).items():
        w = base.get(name)
        if w is None:
            raise ValueError(f"the adapter adapts {name!r}, which the base model does not have")
        if (b.shape[0], a.shape[1]) != tuple(w.shape) or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter for {name!r}: B {tuple(b.shape)} @ A {tuple(a.shape)} "
                             f"does not give the weight's shape {tuple(w.shape)}")
        delta = b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)
        out[name] = (w.float() + scale * delta).to(w.dtype)
    return out


class AdapterMerger:
    """Keeps fp32 copies of the base weights an adapter touches, read once from the base
    model's safetensors (`model_dir`), and merges each new adapter into them (the previous
    adapter never accumulates: every merge starts from the base)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.base: dict[str, torch.Tensor] = {}

    def merge(self, adapter: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
        names = adapted_weights(adapter)
        missing = [n for n in names if n not in self.base]
        if missing:
            self.base.update(read_safetensors(self.model_dir, missing))
        return merge_adapter(self.base, adapter, scale)


def read_safetensors(model_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Just `names` from the model's (possibly sharded) *.safetensors files, each found under
    any of its spellings (a VLM's in-memory names differ from its checkpoint's: weight_names)."""
    from safetensors import safe_open

    wanted = {alias: name for name in names for alias in reversed(spellings(name))}
    out: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in set(wanted).intersection(f.keys()):
                out[wanted[key]] = f.get_tensor(key).float()
    missing = sorted(set(names) - set(out))
    if missing:
        raise ValueError(f"the adapter adapts weights {missing[:3]} that the base model in "
                         f"{model_dir} does not have")
    return out


def read_adapter_dir(path: str | Path) -> tuple[dict[str, torch.Tensor], float]:
    """(adapter tensors, scale) of a `PeftModel.save_pretrained` directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (p / name).is_file():
            # ValueError like a bad weights path: the caller's input, a 400 from a server
            raise ValueError(f"{str(p)!r} is not a PEFT adapter directory: no {name} (expected "
                             f"{ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
    try:
        config = json.loads((p / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(p / ADAPTER_WEIGHTS))
    except (OSError, ValueError, SafetensorError) as err:  # unreadable JSON or weights
        raise ValueError(f"cannot read the adapter at {str(p)!r}: {err}") from err
    return tensors, adapter_scale(config)


def write_adapter_dir(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                      path: str | Path) -> Path:
    """Write an adapter in `PeftModel.save_pretrained`'s layout; `config` is the PEFT config's
    dict (`LoraConfig.to_dict()`)."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    plain = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in config.items()}
    (p / ADAPTER_CONFIG).write_text(json.dumps(plain, indent=2, sort_keys=True, default=str))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
              str(p / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return p
