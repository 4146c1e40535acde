"""`CommandAgent`: an agent that is a program, run once per episode against the proxy session.

The program gets the session in its environment (`OPENAI_BASE_URL` / `OPENAI_API_KEY` for OpenAI
clients, `ANTHROPIC_BASE_URL` / `ANTHROPIC_API_KEY` for Anthropic ones; plus `env`) and the row as
one JSON document on stdin. Its reward is the last non-empty line of its stdout: a number (the
last completion's reward) or a JSON object mapping completion ids to rewards; or, with
`reward: reward_fn`, the run's reward function scores the session's last reply against the row.

It runs in a process group of its own, which is killed whole when the episode ends, times out
(the agent workflow's `timeout_s`) or is cancelled, so no child outlives it. A program that exits
non-zero, prints more than `max_output_bytes`, prints no reward, or leaves processes running
after it exits raises `CommandAgentError` with its kind and reason (the workflow rejects the
episode, counted by kind). `limits` (rlimits: CPU seconds, address space, file size, processes)
are set in the child before it execs the program, as for sandboxed code rewards; there is no
network isolation, since the program must reach the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from typing import Any, Literal

import pydantic

from asyncrl.config import Config

# Sets the rlimits given as JSON in argv[1], then execs argv[2:]: the limits apply to the program
# and its children. A separate interpreter, not a preexec_fn (unsafe in a threaded parent).
_LIMITS = ("import json, os, resource, sys\n"
           "for name, value in json.loads(sys.argv[1]).items():\n"
           "    resource.setrlimit(getattr(resource, name), (value, value))\n"
           "os.execvp(sys.argv[2], sys.argv[2:])\n")
READ_CHUNK = 1 << 16


class CommandLimits(Config):
    """rlimits of the program and its children (None: unlimited)."""

    cpu_seconds: int | None = pydantic.Field(None, ge=1)  # CPU time of each process
    memory_bytes: int | None = pydantic.Field(None, ge=64 << 20)  # address space
    max_file_bytes: int | None = pydantic.Field(None, ge=0)  # largest file it may write
    max_processes: int | None = pydantic.Field(None, ge=1)  # counts all of the user's processes

    def rlimits(self) -> dict[str, int]:
        names = {"cpu_seconds": "RLIMIT_CPU", "memory_bytes": "RLIMIT_AS",
                 "max_file_bytes": "RLIMIT_FSIZE", "max_processes": "RLIMIT_NPROC"}
        return {names[k]: v for k, v in self.model_dump().items() if v is not None}


class CommandAgentError(RuntimeError):
    """The program failed; `kind` names how (exit_code, output_limit, no_reward, left_children)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class CommandAgent:
    """`async def run(data, base_url, api_key, **kw)`: one run of `argv` (see the module doc)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None,
                 cwd: str | None = None, reward: Literal["stdout", "reward_fn"] = "stdout",
                 max_output_bytes: int = 1 << 20, limits: CommandLimits | None = None) -> None:
        if not argv:
            raise ValueError("argv is empty: give the program and its arguments")
        self.argv, self.env, self.cwd = list(argv), dict(env or {}), cwd
        self.reward, self.max_output_bytes = reward, max_output_bytes
        self.limits = limits or CommandLimits()

    @property
    def name(self) -> str:
        """The command as messages name it (shortened)."""
        text = " ".join(self.argv)
        return f"`{text if len(text) <= 80 else text[:77] + '...'}`"

    async def run(self, data: dict[str, Any], base_url: str, api_key: str,
                  **_: Any) -> float | dict[str, float] | None:
        """The reward the program printed (None with reward=reward_fn: the workflow scores the
        session); CommandAgentError when it failed."""
        env = {**os.environ, **self.env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
               "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": api_key}
        argv = self.argv
        if self.limits.rlimits():
            argv = [sys.executable, "-I", "-c", _LIMITS, json.dumps(self.limits.rlimits()),
                    *argv]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, cwd=self.cwd, start_new_session=True)
        try:
            code, stdout, stderr = await self._communicate(proc, json.dumps(data).encode())
        finally:
            _kill_group(proc)
            # reaped (and its pipes closed) before the caller moves on, even when cancelled
            await asyncio.wait({asyncio.ensure_future(proc.wait())}, timeout=10)
        if code != 0:
            tail = stderr.decode(errors="replace").strip()[-500:]
            raise CommandAgentError("exit_code", f"{self.name} exited with {code}: {tail}")
        return None if self.reward == "reward_fn" else self._reward(stdout)

    async def _communicate(self, proc: asyncio.subprocess.Process, stdin: bytes
                           ) -> tuple[int, bytes, bytes]:
        """Write the row, read both streams within max_output_bytes until the program exits and
        they end: (exit code, stdout, stderr). Processes of its group still running once it has
        exited (a child holding the pipes open, or one that closed them) are killed and named."""
        assert proc.stdin and proc.stdout and proc.stderr
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(stdin)
            await proc.stdin.drain()
            proc.stdin.close()

        async def read(stream: asyncio.StreamReader) -> bytes:
            out = bytearray()
            while chunk := await stream.read(READ_CHUNK):
                out += chunk
                if len(out) > self.max_output_bytes:
                    raise CommandAgentError("output_limit", f"{self.name} printed more than "
                                            f"max_output_bytes={self.max_output_bytes}")
            return bytes(out)

        async def leader_exit() -> int:
            # proc.wait() would also wait for the pipes, which a child may hold open
            while proc.returncode is None:
                await asyncio.sleep(0.05)
            return proc.returncode

        readers = asyncio.ensure_future(asyncio.gather(read(proc.stdout), read(proc.stderr)))
        exited = asyncio.ensure_future(leader_exit())
        try:
            await asyncio.wait({readers, exited}, return_when=asyncio.FIRST_COMPLETED)
            if readers.done():
                readers.result()  # an output_limit error propagates from here
                code = await exited
                stray = _group_alive(proc.pid)
            else:  # exited; its pipes may be held open by what it started
                code = exited.result()
                stray = _group_alive(proc.pid)
                _kill_group(proc)
            stdout, stderr = await readers
        finally:
            for task in (readers, exited):
                task.cancel()
                task.add_done_callback(_retrieve)
        if stray:
            raise CommandAgentError("left_children", f"{self.name} exited and left processes "
                                    "running in its group (killed)")
        return code, stdout, stderr

    def _reward(self, stdout: bytes) -> float | dict[str, float]:
        lines = [line.strip() for line in stdout.decode(errors="replace").splitlines()
                 if line.strip()]
        if lines:
            try:
                value = json.loads(lines[-1])
            except ValueError:
                value = None
            if isinstance(value, (int, float, dict)) and not isinstance(value, bool):
                return value
        last = lines[-1][:200] if lines else "nothing"
        raise CommandAgentError("no_reward", f"{self.name}'s last stdout line is {last!r}; "
                                "allowed: a number, or a JSON object of completion id -> "
                                "reward (or set reward: reward_fn)")


def _retrieve(future: asyncio.Future) -> None:
    """Mark a cancelled helper's outcome as seen (a cancelled gather keeps CancelledError as its
    exception, which asyncio would otherwise log as never retrieved)."""
    with contextlib.suppress(asyncio.CancelledError):
        future.exception()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL every process of the program's group (it leads a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
