"""Inference servers as local processes: start, wait until ready, and always stop them.

Each server is `python -m asyncrl.cli serve --port 0 ...` in a session of its own (so a terminal
Ctrl-C reaches only the trainer, which then shuts the servers down in order), with the kernel told
to SIGTERM it should the trainer die without cleaning up (Linux `PR_SET_PDEATHSIG`): no orphan
survives a crash or a SIGKILL of the job. Server output goes to `log_dir/server_<i>.log`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from asyncrl.launch.serve import READY_PREFIX

PR_SET_PDEATHSIG = 1


class ServerStartError(RuntimeError):
    """A server exited or stayed silent before announcing its address."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalServers:
    """`with LocalServers(model_dir, n, log_dir) as servers: servers.urls, servers.api_key`."""

    def __init__(self, model_dir: str | Path, count: int, log_dir: str | Path,
                 overrides: Sequence[str] = (), startup_timeout_s: float = 180.0,
                 api_key: str | None = None) -> None:
        if count < 1:
            raise ValueError(f"count={count} is out of range; allowed [1, inf)")
        self.model_dir, self.count = str(model_dir), count
        self.log_dir = Path(log_dir)
        self.overrides, self.timeout = list(overrides), startup_timeout_s
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def start(self) -> LocalServers:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", ASYNCRL_SERVER_API_KEY=self.api_key)
        cmd = [sys.executable, "-m", "asyncrl.cli", "serve", "--model", self.model_dir,
               "--port", "0", *self.overrides]
        try:
            for i in range(self.count):  # all start together: each spends seconds importing
                log = open(self.log_dir / f"server_{i}.log", "w")  # noqa: SIM115 (child owns it)
                self.procs.append(subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                    start_new_session=True, preexec_fn=_die_with_parent))
                log.close()
            self.urls = [self._wait_ready(i, p) for i, p in enumerate(self.procs)]
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, i: int, proc: subprocess.Popen) -> str:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.timeout)
        got = line[0] if line else ""
        if got.startswith(READY_PREFIX):
            return got[len(READY_PREFIX):].strip()
        status = proc.poll()
        why = (f"exited with status {status}" if status is not None
               else f"printed no address within {self.timeout:.0f}s")
        tail = (self.log_dir / f"server_{i}.log").read_text(errors="replace")[-2000:]
        raise ServerStartError(f"inference server {i} ({self.model_dir}) {why}; "
                               f"log {self.log_dir / f'server_{i}.log'}:\n{tail}")

    def alive(self) -> list[bool]:
        return [p.poll() is None for p in self.procs]

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every server, SIGKILL what is left after `grace_s`."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self.procs.clear()

    def __enter__(self) -> LocalServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
