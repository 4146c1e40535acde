"""LoRA fine-tuning of the policy with PEFT (`train.lora`), and what leaves the trainer with it.

With `train.lora` set, the train engine wraps its model in a PEFT `LoraModel`: the base weights
are frozen, only the low-rank A and B matrices of `target_modules` train, and only they are in the
optimizer (a fraction of a percent of the Adam state of full fine-tuning on a 0.5B model). The
engines are sent the adapter only (`adapter_state_dict`, PEFT's own tensor names), never the full
weights; they merge it into the base model they were started from (models/lora.py). A checkpoint
keeps the adapter in PEFT format and a merged export (`merged_state_dict`), so it serves as a
plain model too.

Under FSDP2 the adapter's parameters are sharded with their layers like any other; gathering the
adapter is one all-gather per LoRA matrix (every rank calls `adapter_state_dict` in the same
order), not a gather of the whole model.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.models.lora import PREFIX, merge_adapter
from asyncrl.train.config import LoraConfig



def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """`model` wrapped in a PEFT LoraModel: base frozen, A random, B zero (so the wrapped model
    starts as the base model exactly)."""
    import peft

    peft_cfg = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                               target_modules=list(cfg.target_modules), bias="none",
                               task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, peft_cfg)
    except ValueError as err:  # e.g. no module matches target_modules
        raise ValueError(f"train.lora.target_modules={cfg.target_modules} on "
                         f"{type(model).__name__}: {err}") from err


def peft_config_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The adapter's PEFT config (what adapter_config.json holds)."""
    return model.peft_config["default"].to_dict()


def _adapter_name(param_name: str) -> str:
    """`...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight` (PEFT's saved names)."""
    return param_name.replace(".default.", ".")


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA matrices, full (unsharded) on every rank, on the CPU, named as
    `get_peft_model_state_dict` names them; under FSDP every rank must call."""
    out = {}
    for name, param in model.named_parameters():
        if ".lora_" not in name:
            continue
        value = param.detach()
        if hasattr(value, "full_tensor"):  # a DTensor shard: all-gather this one matrix
            value = value.full_tensor()
        out[_adapter_name(name)] = value.cpu()
    if not out:
        raise ValueError(f"{type(model).__name__} has no LoRA parameters (.lora_A/.lora_B)")
    return out


def merged_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A PeftModel's state dict -> the plain HF state dict of base + scale * B @ A (HF names);
    an empty dict (a non-zero FSDP rank's) stays empty."""
    base, adapter = {}, {}
    for name, value in state.items():
        if ".lora_" in name:
            adapter[_adapter_name(name)] = value
        else:
            base[name.removeprefix(PREFIX).replace(".base_layer.", ".")] = value
    if not adapter:
        return base
    return {**base, **merge_adapter(base, adapter, scale)}
