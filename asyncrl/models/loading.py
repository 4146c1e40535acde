"""Load a causal LM + tokenizer from a HF directory; build the default tiny one on demand.

`model.path` is a local directory or a hub id (`org/name`, at `model.revision`), which a job
resolves once, at launch, into its snapshot directory in the HF cache (models/hub.py: offline
with HF_HUB_OFFLINE=1); every loader then reads only that directory (`local_files_only=True`), so
a typo in a local path fails at once naming the path, not after a network timeout. `model.path`
unset means the embedded tiny model, built once into a cache directory keyed by its config.
`trust_remote_code` reaches every loader (model, tokenizer, config); without it a directory whose
model type needs its own Python code (`auto_map`) is a one-line error before transformers
would ask on stdin.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedModel

from asyncrl.errors import UserError
from asyncrl.models.export import policy_model_class
from asyncrl.models.hf_quiet import quiet_hf_progress
from asyncrl.models.tiny import DTYPES, build_tiny_model
from asyncrl.models.tokenizer_check import check_round_trip
from asyncrl.models.config import VL_ARCHS, ModelConfig, TinyModelConfig, is_vision_language

# Part of the cache key: bump when the builder's output changes for the same config (tokenizer,
# chat template, file layout), so stale cached models are not silently reused.
# v2: compact tool lines and rendered tool calls in the chat template.
# v3: the byte-level tokenizer (261 ids; the embedding pads to 320 rows).
# v4: seeded_init (the ASCII vocabulary's init, then the other byte rows).
TINY_BUILD_VERSION = 4

# Vocabulary files of the common tokenizer families. transformers 5 silently builds an empty
# one-token tokenizer when none is present, which would only surface as garbage much later.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


class ModelLoadError(UserError):
    """The model directory is missing or is not a HF model directory; the message names the path."""


def check_model_dir(path: str | Path) -> Path:
    """`path` as a Path if it looks like a HF model directory, else ModelLoadError saying why."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model dir {p} not found; expected a local HF model directory "
                             "(config.json + *.safetensors) or a hub id (org/name)")
    if not p.is_dir():
        raise ModelLoadError(f"model dir {p} is a file, not a directory; expected a HF model "
                             "directory (config.json + *.safetensors)")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"model dir {p} has no config.json; expected a HF model directory "
                             "(config.json + *.safetensors)")
    return p


def resolve_model_path(path: str | Path, revision: str | None = None,
                       setting: str = "model.path") -> Path:
    """A local path as given (`~` expanded), or a hub id's snapshot directory in the HF cache.

    Local paths are not checked here (a run or checkpoint directory is a valid input of
    `asyncrl eval`); `check_model_dir` does that. `setting` names the option in errors.
    """
    from asyncrl.models.hub import HubCacheMiss, looks_local, snapshot_dir

    if isinstance(path, Path) or looks_local(path):
        if revision is not None:
            raise ModelLoadError(f"{setting}={path}: revision={revision!r} applies to hub ids "
                                 "(org/name) only, and this is a local path")
        return Path(path).expanduser()
    try:
        return snapshot_dir(path, revision=revision, offline_vars=("TRANSFORMERS_OFFLINE",),
                            setting=setting)
    except HubCacheMiss as err:
        raise ModelLoadError(str(err)) from err.__cause__


def check_remote_code(path: Path, trust_remote_code: bool) -> None:
    """ModelLoadError when the directory's model type exists only as its own Python code
    (config.json `auto_map`, a model_type transformers does not ship) and that code is not
    trusted; transformers would otherwise stop and ask on stdin, or fail with a long hint."""
    if trust_remote_code:
        return
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return  # the loader itself reports an unreadable config
    auto_map = config.get("auto_map") or {}
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if auto_map and config.get("model_type") not in CONFIG_MAPPING:
        code = ", ".join(sorted({f"{str(v).split('.')[0]}.py" for v in auto_map.values()}))
        raise ModelLoadError(
            f"model dir {path}: model_type={config.get('model_type')!r} needs the directory's own "
            f"code ({code}); set model.trust_remote_code=true (--trust-remote-code for "
            "`asyncrl serve` / `asyncrl eval`) if you trust it")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer saved in the local model directory `path`."""
    p = check_model_dir(path)
    check_remote_code(p, trust_remote_code)
    has_vocab = any((p / f).is_file() for f in TOKENIZER_FILES) or any(p.glob("*.tiktoken"))
    if not has_vocab and not trust_remote_code:  # remote code may use its own file names
        raise ModelLoadError(f"model dir {p} has no tokenizer files; expected one of "
                             f"{', '.join(TOKENIZER_FILES)}")
    try:
        # As vLLM, SGLang and users' code load it, so that every part sees the same ids.
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    except OSError as err:  # transformers reports missing/unreadable files as OSError
        raise ModelLoadError(f"model dir {p}: cannot load tokenizer: {err}") from err
    check_round_trip(tokenizer, p)
    return tokenizer


def load_causal_lm(path: str | Path, dtype: str = "float32",
                   trust_remote_code: bool = False) -> PreTrainedModel:
    """The causal LM in the local model directory `path`, in `dtype`, in eval mode on CPU; a
    vision-language model (a config with `vision_config`, e.g. Qwen2-VL) loads as its
    image-text-to-text class, which also generates text."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    p = check_model_dir(path)
    check_remote_code(p, trust_remote_code)
    try:
        with quiet_hf_progress():
            model = policy_model_class(is_vision_language(p)).from_pretrained(
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
                      lambda tmp: build_embedded_model(cfg, tmp))


def build_embedded_model(cfg: TinyModelConfig, out_dir: str | Path) -> Path:
    """The embedded model of `cfg` written to `out_dir`: the text model (models/tiny.py) or,
    with arch qwen2_vl / qwen3_vl, the vision-language one (models/tiny_vl.py)."""
    if cfg.arch in VL_ARCHS:
        from asyncrl.models.tiny_vl import build_tiny_vl_model

        return build_tiny_vl_model(cfg, out_dir)
    return build_tiny_model(cfg, out_dir)


def resolve_model_dir(model: ModelConfig, tiny: TinyModelConfig | None = None) -> Path:
    """`model.path` (a hub id resolved to its cached snapshot) checked as a model directory,
    or the (built on demand) tiny model."""
    if model.path is None:
        return ensure_tiny_model(tiny)
    return check_model_dir(resolve_model_path(model.path, model.revision))

