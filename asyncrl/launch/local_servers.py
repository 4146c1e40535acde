"""Inference servers as local processes: start, wait until ready, and always stop them.

Each server (`asyncrl serve`, vLLM or SGLang: the command lines are in `server_commands.py`) runs
in a session of its own (so a terminal Ctrl-C reaches only the trainer, which then shuts the
servers down in order), with the kernel told to SIGTERM it should the trainer die without cleaning
up (Linux `PR_SET_PDEATHSIG`): no orphan survives a crash or a SIGKILL of the job. Server output
goes to `log_dir/server_<i>.log`. Ready means: the announced address (asyncrl serve, port 0), or
the health route answering 200 on the chosen port (vLLM, SGLang).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx

from asyncrl.errors import UserError
from asyncrl.inference.backend_protocol import READY_PREFIX, ServerCommand

PR_SET_PDEATHSIG = 1
PORT_TRIES = 3  # starts of one server whose port another process took first
ADDRESS_IN_USE = "address already in use"  # errno 98's text (Python's, uvicorn's, ZMQ's)
logger = logging.getLogger(__name__)


class ServerStartError(RuntimeError):
    """A server exited or stayed silent before announcing its address. `port_taken`: it exited
    because another process held the port it was given."""

    def __init__(self, message: str, port_taken: bool = False) -> None:
        super().__init__(message)
        self.port_taken = port_taken


class ServerPythonError(UserError):
    """The interpreter a server command names cannot run it (missing, or without the package)."""


# exits 1 when the module cannot be found, without importing it (vLLM's import takes seconds)
_FIND_SPEC = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"


def check_server_python(cmd: ServerCommand) -> None:
    """A server run as `python -m package...` needs `package` in that python: checked before
    starting (a second), instead of a server that dies during startup with "No module named"."""
    argv = cmd.argv
    if len(argv) < 3 or argv[1] != "-m":
        return
    python, module = argv[0], argv[2].split(".")[0]
    fix = (f"point inference.server_python at the python of a virtual environment that has "
           f"{module} installed (the README's 'Rollouts from vLLM or SGLang servers' builds one)")
    try:
        found = subprocess.run([python, "-c", _FIND_SPEC, module], capture_output=True,
                               text=True, timeout=120, env=dict(os.environ, **cmd.env))
    except (FileNotFoundError, PermissionError) as err:
        raise ServerPythonError(f"inference.server_python={python!r} cannot run ({err}); "
                                f"{fix}") from None
    if found.returncode != 0:
        why = found.stderr.strip().splitlines()[-1:] or [f"no module named {module!r}"]
        raise ServerPythonError(f"inference.server_python={python!r} cannot start the {module} "
                                f"servers: {why[0]}; {fix}")


def new_api_key() -> str:
    """The key of the servers a job starts: hex, so it never starts with "-" (a command line
    would read such a key as a flag)."""
    return secrets.token_hex(24)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _in_child(cpus: Sequence[int] | None) -> None:  # between fork and exec
    _die_with_parent()
    if cpus:  # before exec: every thread the server starts inherits it
        os.sched_setaffinity(0, cpus)


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """`sig` to the session the server leads (start_new_session: its pgid is its pid)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class LocalServers:
    """`with LocalServers(make_command, n, log_dir) as servers: servers.urls, servers.api_key`.

    `make_command(api_key)` returns the ServerCommand of one server (called once per server, so
    each gets its own port)."""

    def __init__(self, make_command: Callable[[str], ServerCommand], count: int,
                 log_dir: str | Path, startup_timeout_s: float = 180.0,
                 api_key: str | None = None, cpus: Sequence[int] | None = None) -> None:
        if count < 1:
            raise ValueError(f"count={count} is out of range; allowed [1, inf)")
        self.make_command, self.count = make_command, count
        self.log_dir = Path(log_dir)
        self.timeout = startup_timeout_s
        self.api_key = api_key or new_api_key()
        self.procs: list[subprocess.Popen] = []
        self.commands: list[ServerCommand] = []
        self.urls: list[str] = []
        self.cpus = cpus  # each server's CPU affinity (None: the OS decides)

    def start(self) -> LocalServers:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        check_server_python(self.make_command(self.api_key))
        try:
            for i in range(self.count):  # all start together: each spends seconds importing
                self._launch(i)
            deadline = time.monotonic() + self.timeout
            self.urls = [self._ready(i, deadline) for i in range(self.count)]
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, i: int) -> None:
        """Start server `i` (again, after a port clash: a fresh command, so a fresh port)."""
        cmd = self.make_command(self.api_key)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **cmd.env)
        log = open(self.log_dir / f"server_{i}.log", "w")  # noqa: SIM115 (child owns it)
        proc = subprocess.Popen(
            cmd.argv, stdout=subprocess.PIPE if cmd.port == 0 else log, stderr=log,
            text=True, env=env, start_new_session=True,
            preexec_fn=functools.partial(_in_child, self.cpus))
        log.close()
        if i < len(self.procs):
            self.procs[i], self.commands[i] = proc, cmd
        else:
            self.procs.append(proc)
            self.commands.append(cmd)

    def _ready(self, i: int, deadline: float) -> str:
        """Server `i`'s URL once ready. A port is chosen free, then bound by the server seconds
        later; should another process take it in between (the server exits with "Address
        already in use"), the server starts again on another port, PORT_TRIES times at most."""
        for attempt in range(PORT_TRIES):
            try:
                return self._wait_ready(i, self.procs[i], self.commands[i], deadline)
            except ServerStartError as err:
                if not err.port_taken or attempt == PORT_TRIES - 1:
                    raise
                logger.warning("inference server %d: port %d was taken before it bound it; "
                               "starting it again on another port", i, self.commands[i].port)
                _signal_group(self.procs[i], signal.SIGKILL)  # children it may have started
                self._launch(i)
        raise AssertionError("unreachable")

    def _wait_ready(self, i: int, proc: subprocess.Popen, cmd: ServerCommand,
                    deadline: float) -> str:
        if cmd.port == 0:
            line: list[str] = []
            reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()),
                                      daemon=True)
            reader.start()
            reader.join(max(0.0, deadline - time.monotonic()))
            got = line[0] if line else ""
            if got.startswith(READY_PREFIX):
                return got[len(READY_PREFIX):].strip()
        else:
            url = f"http://{cmd.host}:{cmd.port}"
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(url + cmd.health_path, timeout=2.0).status_code == 200:
                        return url
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        status = proc.poll()
        why = (f"exited with status {status}" if status is not None
               else f"was not ready within {self.timeout:.0f}s (raise "
                    "inference.startup_timeout_s if it is only slow)")
        log = (self.log_dir / f"server_{i}.log").read_text(errors="replace")
        raise ServerStartError(f"inference server {i} ({' '.join(cmd.argv[:4])} ...) {why}; "
                               f"log {self.log_dir / f'server_{i}.log'}:\n{log[-3000:]}",
                               port_taken=status is not None and cmd.port != 0
                               and ADDRESS_IN_USE in log.lower())

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every server's process group, SIGKILL what is left after `grace_s`.

        Groups, not just the processes started here: a vLLM server runs its engine core and
        workers as child processes (~2 GB each for the tiny model on CPU), which outlive a
        killed parent."""
        for p in self.procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            _signal_group(p, signal.SIGKILL)  # children left behind, or a server that hangs
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self.procs.clear()

    def __enter__(self) -> LocalServers:
        return self.start()

    @contextlib.contextmanager
    def watching(self, engine: object) -> Iterator[None]:
        """Nothing to watch: a local server is not restarted at another address."""
        yield

    def __exit__(self, *exc: object) -> None:
        self.stop()
