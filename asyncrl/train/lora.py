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

import pydantic
import torch

from asyncrl.config import Config
from asyncrl.models.lora import PREFIX, merge_adapter

# every linear projection of a Llama/Qwen2 decoder layer (attention and MLP); QLoRA's choice
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# adapting these breaks the tie of the embedding and the output head, and the engines merge
# Linear layers of the decoder only
REFUSED_TARGETS = ("embed_tokens", "lm_head")


class LoraConfig(Config):
    """`train.lora`: None (the default) trains every weight; any field set turns LoRA on
    (`train.lora.r=8`), `enabled: false` turns it off again."""

    enabled: bool = True
    r: int = pydantic.Field(8, ge=1, le=1024)
    alpha: float = pydantic.Field(16.0, gt=0.0)  # the update is scaled by alpha / r
    dropout: float = pydantic.Field(0.0, ge=0.0, lt=1.0)  # on the LoRA input, training only
    target_modules: list[str] = list(DEFAULT_TARGETS)  # module names (suffixes), as PEFT takes

    @pydantic.field_validator("target_modules")
    @classmethod
    def _linear_decoder_modules(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError(f"target_modules=[] is empty; allowed: module names such as "
                             f"{list(DEFAULT_TARGETS)}")
        bad = [m for m in value if any(r in m for r in REFUSED_TARGETS)]
        if bad:
            raise ValueError(f"target_modules={value} contains {bad}; allowed: the decoder's "
                             f"linear layers, e.g. {list(DEFAULT_TARGETS)} (not "
                             f"{list(REFUSED_TARGETS)})")
        return value

    @property
    def scale(self) -> float:
        return self.alpha / self.r


def lora_enabled(cfg: LoraConfig | None) -> bool:
    return cfg is not None and cfg.enabled


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


def is_lora_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


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
