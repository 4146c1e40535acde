"""The keyword a transformers model's forward takes its KV cache by: `cache` in transformers 5.2x
(`past_key_values` is deprecated there and warns on every call), `past_key_values` before."""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def _name(forward: Any) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_kwargs(module: Any, cache: Any) -> dict[str, Any]:
    """{the keyword `module`'s forward takes a KV cache by: cache}; a PEFT wrapper passes its
    keywords on to the model it wraps, whose forward decides."""
    inner = module.get_base_model() if hasattr(module, "get_base_model") else module
    return {_name(type(inner).forward): cache}
