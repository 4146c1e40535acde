"""The models package's settings: which policy model to load, the embedded tiny model's shape,
and how large each safetensors file of a written model may be. Plain pydantic, no torch or
transformers: a run config loads without importing what these configure."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import pydantic

from asyncrl.config import Config
from asyncrl.models.chat_options import ChatOptions

# The Hub's usual shard size (transformers 4.x's default; 5.x's is 50GB, too big for many
# uploads and for a reader that stages one shard at a time).
DEFAULT_SHARD_SIZE = "5GB"
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_shard_size(value: int | str, field: str = "max_shard_size") -> int:
    """Bytes from `value`: an integer number of bytes or a size such as "5GB", "500MiB"."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)):
        size = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    else:
        size = -1
    if size <= 0:
        raise ValueError(f"{field}={value!r} is not a size; allowed: a number of bytes > 0 or a "
                         "string with a unit B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '5GB')")
    return size


def is_vision_language(path: str | Path) -> bool:
    """Whether the model directory's config.json describes a vision-language model (it has a
    `vision_config`, as Qwen2-VL's); False when there is no such file."""
    try:
        return "vision_config" in json.loads((Path(path).expanduser() / "config.json")
                                             .read_text())
    except (OSError, ValueError):
        return False


MOE_ARCHS = {"qwen3_moe"}  # TinyModelConfig archs with experts
VL_ARCHS = {"qwen2_vl", "qwen3_vl"}  # TinyModelConfig archs that are vision-language models


def is_mixture_of_experts(path: str | Path) -> bool:
    """Whether the model directory's config.json (its text part) has experts (`num_experts` or
    `num_local_experts` > 0, as Qwen3-MoE's and Mixtral's); False when there is no such file."""
    try:
        raw = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = raw.get("text_config") or raw
    return (text.get("num_experts") or text.get("num_local_experts") or 0) > 0


class ModelConfig(ChatOptions):
    """Which policy model to load; `path=None` means the embedded tiny model. Its chat options
    (chat_template_kwargs, reasoning_parser, tool_parser: models/chat_options.py) apply to every
    prompt and reply of the job."""

    # local HF model directory or hub id (org/name); None: the embedded tiny model
    path: str | None = None
    revision: str | None = None  # of a hub id: branch, tag or commit; None: main
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # dtype the weights are loaded in
    trust_remote_code: bool = False  # allow the model's own Python code (HF auto_map)

    @pydantic.model_validator(mode="after")
    def _revision_of_a_hub_id(self) -> ModelConfig:
        # only the obvious cases here: whether `org/name` is a local path depends on the
        # machine the job runs on, which resolve_model_path checks at launch
        if self.revision is not None and (self.path is None
                                          or self.path.startswith(("/", ".", "~"))):
            raise ValueError(f"revision={self.revision!r} applies to a hub id (org/name) only, "
                             f"and path={self.path!r} is not one")
        return self

    def is_vision_language(self, tiny: TinyModelConfig | None = None) -> bool | None:
        """Whether `path` is a vision-language model: None when that cannot be told here (a
        hub id resolved at launch); with no path, whether the embedded model (`tiny`) is."""
        if self.path is None:
            return tiny is not None and tiny.arch in VL_ARCHS
        local = Path(self.path).expanduser()
        return is_vision_language(local) if local.is_dir() else None

    def is_mixture_of_experts(self, tiny: TinyModelConfig | None = None) -> bool | None:
        """Whether `path` is a mixture-of-experts model: None when that cannot be told here (a
        hub id resolved at launch); with no path, whether the embedded model (`tiny`) is."""
        if self.path is None:
            return tiny is not None and tiny.arch in MOE_ARCHS
        local = Path(self.path).expanduser()
        return is_mixture_of_experts(local) if local.is_dir() else None


class TinyModelConfig(Config):
    """Shape of the embedded tiny model; its hash names the cache directory it is built into."""

    # HF architecture of the embedded model; qwen2_vl / qwen3_vl: a vision-language model (a
    # Qwen2-VL / Qwen3-VL whose text side has this shape, with a small vision tower: tiny_vl.py)
    # qwen3_moe: a mixture-of-experts Qwen3 (num_experts experts of intermediate_size //
    # experts_per_token each, experts_per_token per token: the dense model's active MLP width)
    arch: Literal["qwen2", "llama", "qwen2_vl", "qwen3_vl", "qwen3_moe"] = "qwen2"
    hidden_size: int = pydantic.Field(256, ge=8)  # width of the residual stream
    num_layers: int = pydantic.Field(8, ge=1)  # decoder layers
    num_heads: int = pydantic.Field(4, ge=1)  # attention (query) heads
    # key/value heads (grouped-query attention when < num_heads)
    num_kv_heads: int = pydantic.Field(2, ge=1)
    intermediate_size: int = pydantic.Field(768, ge=1)  # MLP width
    # longest sequence (prompt + completion)
    max_position_embeddings: int = pydantic.Field(1024, ge=16)
    rope_theta: float = pydantic.Field(10000.0, gt=0)  # RoPE base frequency
    tie_word_embeddings: bool = True  # the output head shares the embeddings
    vocab_multiple: int = pydantic.Field(64, ge=1)  # pad the embedding rows for aligned matmuls
    seed: int = 0  # the random initial weights
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # dtype of the saved weights
    # arch qwen3_moe: experts in each MoE layer (None: 4; unset fields are left out of the
    # saved config, so a dense model's cache directory keeps its name)
    num_experts: int | None = pydantic.Field(None, ge=2, exclude_if=lambda v: v is None)
    # arch qwen3_moe: experts each token is routed to (None: 2)
    experts_per_token: int | None = pydantic.Field(None, ge=1, exclude_if=lambda v: v is None)

    @pydantic.model_validator(mode="after")
    def _check_experts(self) -> TinyModelConfig:
        if self.arch not in MOE_ARCHS:
            for name in ("num_experts", "experts_per_token"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}={getattr(self, name)} applies to a mixture-of-"
                                     f"experts arch (allowed: {sorted(MOE_ARCHS)}); arch="
                                     f"{self.arch!r} is dense")
            return self
        if self.top_k > self.experts:
            raise ValueError(f"experts_per_token={self.top_k} is out of range; allowed [1, "
                             f"num_experts={self.experts}]")
        if self.intermediate_size % self.top_k:
            raise ValueError(f"intermediate_size={self.intermediate_size} must be divisible by "
                             f"experts_per_token={self.top_k} (each expert's width)")
        return self

    @property
    def experts(self) -> int:
        return self.num_experts or 4

    @property
    def top_k(self) -> int:
        return self.experts_per_token or 2

    @pydantic.model_validator(mode="after")
    def _check_head_shapes(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads} "
                "(grouped-query attention shares each KV head across a whole group of query heads)"
            )
        return self


