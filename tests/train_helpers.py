"""Helpers importable by dotted path from `asyncrl train` subprocesses (PYTHONPATH=tests)."""

import os
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
