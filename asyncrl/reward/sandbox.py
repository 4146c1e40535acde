"""Run an untrusted Python program in a sandbox and report what it printed and how it ended.

The program runs in a separate process tree started through `sandbox_launcher.py` (read its
docstring for the isolation sequence). Here, on the trusted side: write the program and its stdin
into a fresh temporary directory, start the launcher, read stdout/stderr incrementally while
enforcing the wall-clock and output limits, kill the sandbox when either is exceeded, classify the
outcome and delete the directory.

Limits and where each is enforced:
- cpu_seconds, memory_bytes (address space), max_processes, max_file_bytes: rlimits in the child;
  max_processes works because the child runs under a uid of its own (root is exempt from NPROC);
- wall_seconds, max_output_bytes: this module, which kills the sandbox's PID namespace;
- network="namespace": a fresh network namespace whose only interface, loopback, is down. It also
  demands the rest (mount/PID namespaces, read-only filesystem, unprivileged uid); when the machine
  cannot provide them `run_sandboxed` raises SandboxUnavailable instead of running with less.
  network="allow_unsafe" uses whatever else is available and never refuses. Without root that is
  rlimits only: no filesystem isolation, and RLIMIT_NPROC then counts all of the user's processes.

Call this from a single-threaded process (a RewardPool worker): it starts a subprocess and blocks
for up to wall_seconds.
"""

from __future__ import annotations

import enum
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pydantic

from asyncrl.config import Config
from asyncrl.errors import UserError

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
# Sandboxes run as UID_BASE + launcher pid: far above any uid a distribution hands out.
UID_BASE = 0x10000000
WORKDIR_PREFIX = "asyncrl-sandbox-"
PROGRAM_FILE, STDIN_FILE = "main.py", "stdin.txt"
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
READ_CHUNK = 1 << 16
# Time the launcher gets to tear the sandbox down after SIGTERM before it is SIGKILLed itself.
STOP_GRACE_SECONDS = 1.0


class SandboxStatus(enum.Enum):
    OK = "ok"
    TIMEOUT = "timeout"  # wall-clock or CPU limit
    MEMORY = "memory"
    OUTPUT_LIMIT = "output_limit"
    RUNTIME_ERROR = "runtime_error"  # non-zero exit, e.g. an uncaught exception
    KILLED = "killed"  # ended by a signal other than the CPU limit


class SandboxUnavailable(UserError):
    """The isolation the limits demand is not available on this machine."""


class SandboxLimits(Config):
    cpu_seconds: int = pydantic.Field(default=5, ge=1, le=3600)
    wall_seconds: float = pydantic.Field(default=10.0, gt=0, le=3600)
    memory_bytes: int = pydantic.Field(default=1 << 30, ge=64 << 20)
    max_processes: int = pydantic.Field(default=16, ge=1, le=4096)
    max_file_bytes: int = pydantic.Field(default=16 << 20, ge=0)
    max_output_bytes: int = pydantic.Field(default=1 << 20, ge=1)
    network: Literal["namespace", "allow_unsafe"] = "namespace"
    # Interpreter for the program (standard library only: it runs with -I -S). Empty: this
    # interpreter if the sandbox uid can reach it, else the system python3.
    python: str = ""


@dataclass(frozen=True)
class SandboxResult:
    status: SandboxStatus
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal; None: no report (sandbox killed)
    wall_seconds: float
    cpu_seconds: float
    isolation: tuple[str, ...]  # mechanisms that were in force, e.g. "network_namespace"


def run_sandboxed(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a Python program with `stdin`; never raises for anything the program does."""
    limits = limits or SandboxLimits()
    _remove_stale_workdirs()
    workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")
    try:
        Path(workdir, PROGRAM_FILE).write_text(code)
        Path(workdir, STDIN_FILE).write_text(stdin)
        return _run_in(workdir, limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_in(workdir: str, limits: SandboxLimits) -> SandboxResult:
    status_read, status_write = os.pipe()
    spec = _launch_spec(workdir, limits, status_write)
    start = time.monotonic()
    try:
        with open(Path(workdir, STDIN_FILE), "rb") as stdin:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(spec)],
                stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(status_write,), cwd=workdir, env={},
            )
        os.close(status_write)
        status_write = -1
        stdout, stderr, stopped = _collect(proc, limits, start + limits.wall_seconds)
        wall = time.monotonic() - start
        report = _read_reports(status_read)
    finally:
        if status_write >= 0:
            os.close(status_write)
        os.close(status_read)
    if "unavailable" in report:
        raise SandboxUnavailable(
            f"sandbox isolation unavailable: {report['unavailable']}. It needs Linux, root (or "
            "CAP_SYS_ADMIN + CAP_SETUID) and namespaces. To run untrusted code with resource "
            "limits only (no network or filesystem isolation) set network=allow_unsafe explicitly"
        )
    exit_code = report.get("exit_code")
    cpu = float(report.get("cpu_seconds", 0.0))
    return SandboxResult(
        status=stopped or _classify(exit_code, cpu, stderr, limits),
        stdout=stdout.decode(errors="replace"), stderr=stderr.decode(errors="replace"),
        exit_code=exit_code, wall_seconds=wall, cpu_seconds=cpu,
        isolation=tuple(report.get("isolation", ())),
    )


def _launch_spec(workdir: str, limits: SandboxLimits, status_fd: int) -> dict:
    return {
        "workdir": workdir,
        "program": PROGRAM_FILE,
        "python": limits.python or _default_python(),
        "uid_base": UID_BASE,
        "parent_pid": os.getpid(),
        "status_fd": status_fd,
        "network_namespace": limits.network == "namespace",
        "require_isolation": limits.network == "namespace",
        "env": {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
        "rlimits": {
            "RLIMIT_CPU": limits.cpu_seconds,
            "RLIMIT_AS": limits.memory_bytes,
            "RLIMIT_NPROC": limits.max_processes,
            "RLIMIT_FSIZE": limits.max_file_bytes,
            "RLIMIT_CORE": 0,
            "RLIMIT_NOFILE": 256,
        },
    }


def _collect(proc: subprocess.Popen, limits: SandboxLimits, deadline: float):
    """Read stdout/stderr until EOF and exit; (stdout, stderr, status if we had to stop it)."""
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    total = 0
    stopped = None
    with selectors.DefaultSelector() as selector:
        for pipe in buffers:
            os.set_blocking(pipe.fileno(), False)
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map() and stopped is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stopped = SandboxStatus.TIMEOUT
                break
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                # Keep at most the limit in memory: a program printing 100 MB costs us 1 MB.
                buffers[key.fileobj] += chunk[: max(limits.max_output_bytes - total, 0)]
                total += len(chunk)
                if total > limits.max_output_bytes:
                    stopped = SandboxStatus.OUTPUT_LIMIT
                    break
    if stopped is None:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            stopped = SandboxStatus.TIMEOUT
    if stopped is not None:
        _stop(proc)
    proc.stdout.close()
    proc.stderr.close()
    return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), stopped


def _stop(proc: subprocess.Popen) -> None:
    # SIGTERM asks the launcher to SIGKILL the namespace's PID 1 and reap it; the kernel kills the
    # rest of the namespace before that wait returns, so nothing outlives this call.
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()  # PID 1 has PR_SET_PDEATHSIG=SIGKILL, so it follows the launcher
        proc.wait()


def _read_reports(fd: int) -> dict:
    """Merge the launcher's JSON lines; the launcher has exited, so never block."""
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    merged: dict = {}
    for line in data.splitlines():
        merged.update(json.loads(line))
    return merged


def _classify(exit_code: int | None, cpu: float, stderr: bytes, limits: SandboxLimits):
    if exit_code is None:
        return SandboxStatus.KILLED
    if exit_code == 0:
        return SandboxStatus.OK
    if exit_code < 0:
        # RLIMIT_CPU with soft == hard ends in SIGKILL (SIGXCPU when the program handles it).
        at_cpu_limit = cpu >= limits.cpu_seconds - 0.05
        if -exit_code in (signal.SIGXCPU, signal.SIGKILL) and at_cpu_limit:
            return SandboxStatus.TIMEOUT
        return SandboxStatus.KILLED
    if b"MemoryError" in stderr[-4096:]:
        return SandboxStatus.MEMORY
    return SandboxStatus.RUNTIME_ERROR


def _default_python() -> str:
    for candidate in (sys.executable, *SYSTEM_PYTHONS):
        if candidate and _reachable_by_others(candidate):
            return candidate
    raise SandboxUnavailable(
        f"no Python interpreter the sandbox uid can execute: {sys.executable} sits in a directory "
        "closed to other users and no system python3 exists; set python=/path/to/python3"
    )


def _reachable_by_others(path: str) -> bool:
    """True when an unprivileged uid can execute `path` (every parent directory searchable)."""
    real = Path(os.path.realpath(path))
    try:
        if not real.stat().st_mode & stat.S_IXOTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in real.parents)
    except OSError:
        return False


def _remove_stale_workdirs() -> None:
    """Delete work dirs of processes that died mid-run and nobody cleaned up after."""
    root = Path(tempfile.gettempdir())
    for path in root.glob(f"{WORKDIR_PREFIX}*-*"):
        owner = path.name[len(WORKDIR_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(path, ignore_errors=True)


def remove_workdirs_of(pid: int) -> None:
    """Delete the work dirs of process `pid`, which is dead (the RewardPool calls this right
    after it kills a worker that was running a sandbox, so nothing waits for a later call)."""
    for path in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}{pid}-*"):
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
