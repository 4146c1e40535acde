"""Load a causal LM + tokenizer from a local HF directory; build the default tiny one on demand.

Only local directories are accepted (`local_files_only=True`): these machines have no hub access,
and a typo in `model.path` should fail at once with the path in the message, not after a network
timeout or with transformers' "is not a valid model identifier" hint about the hub. `model.path`
unset means the embedded tiny model, built once into a cache directory keyed by its config.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedModel,
                          PreTrainedTokenizerFast)

from asyncrl.config import Config
from asyncrl.errors import UserError
from asyncrl.models.hf_quiet import quiet_hf_progress
from asyncrl.models.tiny import DTYPES, TinyModelConfig, build_tiny_model

# Part of the cache key: bump when the builder's output changes for the same config (tokenizer,
# chat template, file layout), so stale cached models are not silently reused.
# v2: compact tool lines and rendered tool calls in the chat template.
TINY_BUILD_VERSION = 2

# Vocabulary files of the common tokenizer families. transformers 5 silently builds an empty
# one-token tokenizer when none is present, which would only surface as garbage much later.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


class ModelLoadError(UserError):
    """The model directory is missing or is not a HF model directory; the message names the path."""


class ModelConfig(Config):
    """Which policy model to load; `path=None` means the embedded tiny model."""

    path: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False


def check_model_dir(path: str | Path) -> Path:
    """`path` as a Path if it looks like a HF model directory, else ModelLoadError saying why."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model dir {p} not found; expected a local HF model directory "
                             "(config.json + *.safetensors); hub ids are not downloaded")
    if not p.is_dir():
        raise ModelLoadError(f"model dir {p} is a file, not a directory; expected a HF model "
                             "directory (config.json + *.safetensors)")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"model dir {p} has no config.json; expected a HF model directory "
                             "(config.json + *.safetensors)")
    return p


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer saved in the local model directory `path`."""
    p = check_model_dir(path)
    has_vocab = any((p / f).is_file() for f in TOKENIZER_FILES) or any(p.glob("*.tiktoken"))
    if not has_vocab and not trust_remote_code:  # remote code may use its own file names
        raise ModelLoadError(f"model dir {p} has no tokenizer files; expected one of "
                             f"{', '.join(TOKENIZER_FILES)}")
    try:
        if _tokenizer_class(p) in ("PreTrainedTokenizerFast", "TokenizersBackend"):
            # transformers 5 picks the tokenizer class from the model type (qwen2 ->
            # Qwen2Tokenizer, whose pre-tokenizer drops spaces from the tiny model's text);
            # a directory that names the generic class (4.x or 5.x spelling) gets exactly its
            # tokenizer.json.
            return PreTrainedTokenizerFast.from_pretrained(p, local_files_only=True)
        return AutoTokenizer.from_pretrained(p, local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    except OSError as err:  # transformers reports missing/unreadable files as OSError
        raise ModelLoadError(f"model dir {p}: cannot load tokenizer: {err}") from err


def _tokenizer_class(p: Path) -> str | None:
    config = p / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def load_causal_lm(path: str | Path, dtype: str = "float32",
                   trust_remote_code: bool = False) -> PreTrainedModel:
    """The causal LM in the local model directory `path`, in `dtype`, in eval mode on CPU."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    p = check_model_dir(path)
    try:
        with quiet_hf_progress():
            model = AutoModelForCausalLM.from_pretrained(
                p, dtype=DTYPES[dtype], local_files_only=True, trust_remote_code=trust_remote_code
            )
    except OSError as err:  # e.g. config.json present but no weight files
        raise ModelLoadError(f"model dir {p}: cannot load model weights: {err}") from err
    return model.eval()


def cache_root() -> Path:
    """Root of asyncrl's caches: $ASYNCRL_CACHE, else ~/.cache/asyncrl."""
    root = os.environ.get("ASYNCRL_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "asyncrl"


def tiny_config_hash(cfg: TinyModelConfig) -> str:
    payload = f"v{TINY_BUILD_VERSION}\n{cfg.to_yaml()}"
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_model_dir(cfg: TinyModelConfig | None = None) -> Path:
    """Where the tiny model for `cfg` (default: TinyModelConfig()) is cached."""
    cfg = cfg or TinyModelConfig()
    return cache_root() / "models" / f"tiny-{tiny_config_hash(cfg)}"


def build_once(out: Path, marker: str, build: Callable[[Path], Any]) -> Path:
    """`out`, running `build(tmp_dir)` first unless `out/marker` exists (a finished build).

    Built in a temporary sibling directory and renamed into place, so a crash mid-write never
    leaves a directory that looks complete; two processes racing both build (from the same key,
    so the same result) and one rename wins.
    """
    if (out / marker).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        build(tmp)
        if out.exists() and not (out / marker).is_file():
            shutil.rmtree(out)  # not ours to trust: no marker means it never finished
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / marker).is_file():
                raise  # else another process finished first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_tiny_model(cfg: TinyModelConfig | None = None) -> Path:
    """The cached tiny model directory for `cfg`, building it first if it is not there yet."""
    cfg = cfg or TinyModelConfig()
    return build_once(default_model_dir(cfg), "config.json",
                      lambda tmp: build_tiny_model(cfg, tmp))


def resolve_model_dir(model: ModelConfig, tiny: TinyModelConfig | None = None) -> Path:
    """`model.path` checked as a model directory, or the (built on demand) tiny model."""
    if model.path is None:
        return ensure_tiny_model(tiny)
    return check_model_dir(model.path)

