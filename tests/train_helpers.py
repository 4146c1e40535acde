"""Helpers importable by dotted path from `asyncrl train` subprocesses (PYTHONPATH=tests)."""

import os
import time
from pathlib import Path


def digit_reward(completion: str, row: dict) -> float:
    """Varies on an untrained model (some completions hold a digit, some not)."""
    return 1.0 if any(c.isdigit() for c in completion) else 0.0


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains `text` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="ignore")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def wait_gone(*texts: str, seconds: float = 60.0) -> None:
    """Every process whose command line contains one of `texts` exits within `seconds`
    (teardown is asynchronous: signals, Ray ending its actors)."""
    deadline = time.monotonic() + seconds
    while any(processes_mentioning(t) for t in texts) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert {t: processes_mentioning(t) for t in texts} == {t: [] for t in texts}


def sharded_parts(ckpt: Path) -> set[str]:
    """The sharded parts a run checkpoint holds (`trainer`, `critic`), read off its DCP index."""
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(Path(ckpt) / "state").read_metadata().state_dict_metadata
    return {key.split(".")[0] for key in keys}


def server_command(backend: str, model_dir, **launch):
    """The command the job would start a `backend` server with (its plugin config writes it);
    `launch`: ServerLaunch fields (python defaults to this interpreter)."""
    import sys

    from asyncrl.inference.backends import BACKENDS
    from asyncrl.inference.backend_protocol import ServerLaunch

    launch.setdefault("python", sys.executable)
    if "extra_args" in launch:
        launch["extra_args"] = tuple(launch["extra_args"])
    return BACKENDS.parse(backend).server_command(str(model_dir), ServerLaunch(**launch))


def make_backend(name: str, **kwargs):
    """The wire adapter of backend `name` (what the job's plugin config builds)."""
    from asyncrl.inference.backends import BACKENDS

    return BACKENDS.parse(name).build(**kwargs)
