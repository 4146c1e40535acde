"""Hub-style ids (`org/name`) resolved to a local snapshot directory, by the usual HF rules.

Models and datasets are named the way the rest of the ecosystem names them: a local path, or a
hub repo id resolved through `huggingface_hub.snapshot_download` into the HF hub cache
(`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub). Offline
(`HF_HUB_OFFLINE=1`, or `TRANSFORMERS_OFFLINE` / `HF_DATASETS_OFFLINE` for their libraries) only
the cache is read, and a miss is a one-line error naming the id, the cache looked in and the fix;
online it downloads as `transformers` / `datasets` would.

The environment is read at call time, not from `huggingface_hub.constants` (fixed at import):
a job or test that sets HF_HUB_CACHE after importing transformers must still be honoured.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from asyncrl.errors import UserError

# huggingface_hub's own repo-id rule: one optional namespace, then the name.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")

# Weight formats transformers does not load: a full snapshot would fetch them for nothing
# (a TF/Flax/ONNX/GGUF copy or the original consolidated.pth can double a download).
IGNORED_WEIGHTS = ["*.h5", "*.msgpack", "*.onnx", "*.ot", "*.gguf", "original/*"]

TRUE = ("1", "true", "yes", "on")


class HubCacheMiss(UserError):
    """A hub id that is not in the local cache while offline (or cannot be fetched online)."""


def looks_local(path: str) -> bool:
    """Whether `path` names a local path rather than a hub id.

    A path wins whenever it could be one: it starts with / . ~, exists, has more than one `/`
    (hub ids have at most one), or its first component exists here (`runs/x` with a `runs/`
    directory), so a typo in a local path keeps the "not found" error naming the path instead
    of becoming a hub lookup.
    """
    if path.startswith(("/", ".", "~")):
        return True
    if Path(path).exists() or not HUB_ID.fullmatch(path):
        return True
    return "/" in path and Path(path.split("/", 1)[0]).exists()


def hub_offline(*extra_vars: str) -> bool:
    """HF_HUB_OFFLINE (and the library-specific `extra_vars`) as the environment says now."""
    from huggingface_hub import constants

    names = ("HF_HUB_OFFLINE", *extra_vars)
    return constants.HF_HUB_OFFLINE or any(
        os.environ.get(n, "").strip().lower() in TRUE for n in names)


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps snapshots: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def cached_revisions(cache: Path, repo_id: str, repo_type: str) -> list[str]:
    """The branch names and commits the cache holds for a repo (none when it holds none)."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    refs = sorted(p.name for p in (repo / "refs").glob("*") if p.is_file())
    return refs + sorted(p.name for p in (repo / "snapshots").glob("*") if p.is_dir())


def snapshot_dir(repo_id: str, *, repo_type: str = "model", revision: str | None = None,
                 offline_vars: tuple[str, ...] = (), setting: str = "path") -> Path:
    """The local snapshot directory of hub repo `repo_id` at `revision` (default: main).

    `setting` names the config field in errors (`model.path`, `data.name`); `offline_vars`
    are the library's own offline switches besides HF_HUB_OFFLINE.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    offline = hub_offline(*offline_vars)
    cache = hub_cache_dir()
    at = f"@{revision}" if revision else ""
    try:
        return Path(snapshot_download(
            repo_id, repo_type=repo_type, revision=revision, cache_dir=str(cache),
            local_files_only=offline, ignore_patterns=IGNORED_WEIGHTS if repo_type == "model"
            else None))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        how = ("download it once where the hub is reachable (or copy that cache here), or point "
               f"{setting} at a local directory")
        mode = "offline (HF_HUB_OFFLINE)" if offline else "hub not reachable"
        cached = cached_revisions(cache, repo_id, repo_type)
        if revision and cached:
            raise HubCacheMiss(f"{setting}={repo_id}{at}: revision not in the HF cache {cache} "
                               f"and {mode}; cached: {', '.join(cached)}") from err
        raise HubCacheMiss(f"{setting}={repo_id}{at}: {repo_type} not found in the HF cache "
                           f"{cache} and {mode}; {how}") from err
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise HubCacheMiss(f"{setting}={repo_id}{at}: no such {repo_type} repo or revision on "
                           f"the hub, or no access ({type(err).__name__}; private and gated "
                           "repos need HF_TOKEN); a local path must start with / . or ~ or "
                           "exist") from err
