"""Code sandbox and code reward: isolation, limits, and the adversarial suite through a RewardPool.

Every adversarial case must come back within its timeout + MARGIN_S (3 s: a busy machine) with
score 0, and the pool must still score a correct program 1.0 afterwards. Tests that need namespaces and root skip with the
launcher's reason when the machine cannot provide them; they never pass without isolation.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from asyncrl.reward import sandbox as sandbox_module
from asyncrl.reward.code import code_reward_with_note, extract_program, run_tests
from asyncrl.reward.math_verify import math_answer_reward
from asyncrl.reward.pool import RewardPool, RewardPoolConfig, RewardStatus
from asyncrl.reward.sandbox import (
    UID_BASE,
    SandboxLimits,
    SandboxStatus,
    SandboxUnavailable,
    run_sandboxed,
)

FULL_ISOLATION = {"network_namespace", "mount_namespace", "pid_namespace", "readonly_filesystem",
                  "unprivileged_uid"}
LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=2.0, memory_bytes=512 << 20, max_processes=8,
                       max_file_bytes=1 << 20, max_output_bytes=1 << 20)
POOL_TIMEOUT = 3.0
# Inside the pool the sandbox must give up before the pool does, so those cases test the sandbox
# (1.5 s of margin for its teardown on a busy machine).
# What a limit may take past its own seconds to be enforced and reported on a busy machine.
MARGIN_S = 3.0
POOL_LIMITS = LIMITS.model_copy(update={"wall_seconds": 1.5})
REPO = Path(__file__).resolve().parents[1]
TIMINGS: dict[str, float] = {}


def _isolation_or_reason() -> str | None:
    try:
        result = run_sandboxed("pass", "", LIMITS)
    except SandboxUnavailable as err:
        return str(err)
    missing = FULL_ISOLATION - set(result.isolation)
    return f"isolation mechanisms missing: {sorted(missing)}" if missing else None


SKIP_REASON = _isolation_or_reason()
needs_isolation = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))


def sandbox_processes() -> list[int]:
    """PIDs running under a sandbox uid: there must be none once a run has returned."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid_line = next(l for l in status.read_text().splitlines() if l.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(uid_line.split()[1]) >= UID_BASE:
            pids.append(int(status.parent.name))
    return pids


def leftover_workdirs() -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"{sandbox_module.WORKDIR_PREFIX}{os.getpid()}-*"))


def timed(name: str, fn, *args, **kwargs):
    start = time.monotonic()
    value = fn(*args, **kwargs)
    TIMINGS[name] = time.monotonic() - start
    print(f"\n[timing] {name}: {TIMINGS[name]:.2f}s")
    return value, TIMINGS[name]


# -- programs -----------------------------------------------------------------------------------

INFINITE_LOOP = "while True:\n    pass\n"
SLEEP_FOREVER = "import time\ntime.sleep(1000)\n"
FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
ALLOCATE_4GB = "x = bytearray(4 * 2**30)\nprint(len(x))\n"
HUNDRED_MB_OUTPUT = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)\n"
SPAWN_50 = """
import os, time
started, error = 0, None
for _ in range(50):
    try:
        pid = os.fork()
    except OSError as err:
        error = err.errno
        continue
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    started += 1
print(started, error)
"""
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "40 2\n", "output": "42"}]


def connect_program(host: str, port: int) -> str:
    # Prints the expected answer only if the connection succeeds: success would score 1.0.
    return (f"import socket\ns = socket.create_connection(({host!r}, {port}), timeout=1)\n"
            "print(3)\n")


def escape_program(paths: list[str]) -> str:
    return (f"wrote = 0\nfor p in {paths!r}:\n    try:\n        open(p, 'w').write('x')\n"
            "        wrote += 1\n    except OSError:\n        pass\nprint(3 if wrote else 0)\n")


def escape_paths() -> list[str]:
    tag = uuid.uuid4().hex
    return [str(REPO / f"escape-{tag}"), f"/root/escape-{tag}", f"/tmp/escape-{tag}",
            f"/var/tmp/escape-{tag}", f"/dev/shm/escape-{tag}", str(Path.home() / f"escape-{tag}")]


# -- the sandbox on its own ---------------------------------------------------------------------

@needs_isolation
def test_runs_program_with_stdin_as_unprivileged_uid():
    result = run_sandboxed("import os\nprint(input()[::-1], os.getuid() != 0, os.getpid())",
                           "olleh\n", LIMITS)
    assert result.status is SandboxStatus.OK, result.stderr
    assert result.stdout.split() == ["hello", "True", "1"]  # PID 1: its own PID namespace
    assert FULL_ISOLATION <= set(result.isolation)
    assert not leftover_workdirs()


@needs_isolation
def test_runtime_error_and_file_size_limit():
    result = run_sandboxed("raise SystemExit(3)", "", LIMITS)
    assert (result.status, result.exit_code) == (SandboxStatus.RUNTIME_ERROR, 3)
    big_write = "open('big.bin', 'wb').write(b'x' * (2 << 20))\n"
    result = run_sandboxed(big_write, "", LIMITS)
    assert result.status is SandboxStatus.RUNTIME_ERROR
    assert "File too large" in result.stderr


@needs_isolation
def test_infinite_loop_hits_cpu_limit():
    result, elapsed = timed("sandbox infinite loop", run_sandboxed, INFINITE_LOOP, "", LIMITS)
    assert result.status is SandboxStatus.TIMEOUT
    # On an idle machine the CPU limit ends it after ~1 s; under load the wall limit may come
    # first. The contract is the same either way: back within the timeout + MARGIN_S, scored 0.
    assert elapsed < max(LIMITS.cpu_seconds, LIMITS.wall_seconds) + MARGIN_S


@needs_isolation
def test_sleeping_program_hits_wall_limit():
    result, elapsed = timed("sandbox sleep forever", run_sandboxed, SLEEP_FOREVER, "", LIMITS)
    assert result.status is SandboxStatus.TIMEOUT
    assert elapsed < LIMITS.wall_seconds + MARGIN_S


@pytest.fixture(scope="module")
def process_limit_holds():
    """Prove RLIMIT_NPROC binds (50 forks, limit 8) before anything runs a real fork bomb."""
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    result = run_sandboxed(SPAWN_50, "", LIMITS)
    started, error = result.stdout.split()
    # PID 1 itself counts against the limit of 8.
    if not (result.status is SandboxStatus.OK and int(started) <= 7 and error == "11"):
        pytest.fail(f"process limit does not hold, not running a fork bomb: {result}")
    assert not sandbox_processes()


def test_spawning_50_processes_stops_at_the_limit(process_limit_holds):
    pass  # the fixture is the test; a named test makes a failure easy to spot


def test_fork_bomb_is_contained(process_limit_holds):
    result, elapsed = timed("sandbox fork bomb", run_sandboxed, FORK_BOMB, "", LIMITS)
    assert result.status is SandboxStatus.TIMEOUT
    assert elapsed < LIMITS.wall_seconds + MARGIN_S
    assert not sandbox_processes()  # the PID namespace died with its PID 1


@needs_isolation
def test_4gb_allocation_fails():
    result, elapsed = timed("sandbox 4 GB allocation", run_sandboxed, ALLOCATE_4GB, "", LIMITS)
    assert result.status is SandboxStatus.MEMORY
    assert elapsed < LIMITS.wall_seconds + MARGIN_S


@needs_isolation
def test_100mb_output_is_cut_at_the_limit():
    result, elapsed = timed("sandbox 100 MB output", run_sandboxed, HUNDRED_MB_OUTPUT, "", LIMITS)
    assert result.status is SandboxStatus.OUTPUT_LIMIT
    assert len(result.stdout) <= LIMITS.max_output_bytes
    assert elapsed < LIMITS.wall_seconds + MARGIN_S


@needs_isolation
def test_network_is_unreachable():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        for host, where in (("127.0.0.1", port), ("1.1.1.1", 53)):
            result = run_sandboxed(connect_program(host, where), "", LIMITS)
            assert result.status is SandboxStatus.RUNTIME_ERROR
            # ENETUNREACH, not a timeout: no interface is up, so this holds with internet too.
            assert "Network is unreachable" in result.stderr, result.stderr
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host's loopback


@needs_isolation
def test_writes_outside_the_workdir_fail():
    paths = escape_paths()
    code = escape_program(paths) + "open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())\n"
    result = run_sandboxed(code, "", LIMITS)
    assert result.status is SandboxStatus.OK, result.stderr
    assert result.stdout.split() == ["0", "ok"]  # nothing outside, the work dir is writable
    assert not [p for p in paths if os.path.exists(p)]
    assert not leftover_workdirs()


@needs_isolation
def test_namespace_mode_refuses_without_isolation(tmp_path, monkeypatch):
    """Run the launcher as an unprivileged user: network=namespace must refuse, not degrade."""
    if not Path("/usr/bin/python3").exists() or os.geteuid() != 0:
        pytest.skip("needs root and /usr/bin/python3 to start the launcher as uid 65534")
    wrapper = tmp_path / "as_nobody.py"
    wrapper.write_text(
        # The parent (root) made the work dir; a non-root deployment would own it already.
        "import os, sys\nfor p in ('.', 'main.py', 'stdin.txt'):\n    os.chown(p, 65534, 65534)\n"
        "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
        f"os.execv('/usr/bin/python3', ['python3', '-I', '-S', {str(sandbox_module.LAUNCHER)!r}]"
        " + sys.argv[1:])\n")
    monkeypatch.setattr(sandbox_module, "LAUNCHER", wrapper)
    with pytest.raises(SandboxUnavailable, match="network=allow_unsafe"):
        run_sandboxed("print(1)", "", LIMITS)
    unsafe = LIMITS.model_copy(update={"network": "allow_unsafe"})
    result = run_sandboxed("print(1)", "", unsafe)
    assert (result.status, result.stdout, result.isolation) == (SandboxStatus.OK, "1\n", ())


@needs_isolation
def test_allow_unsafe_as_root_keeps_all_but_the_network_namespace():
    unsafe = LIMITS.model_copy(update={"network": "allow_unsafe"})
    with socket.create_server(("127.0.0.1", 0)) as server:
        result = run_sandboxed(connect_program("127.0.0.1", server.getsockname()[1]), "", unsafe)
        assert (result.status, result.stdout) == (SandboxStatus.OK, "3\n"), result.stderr
    assert set(result.isolation) == FULL_ISOLATION - {"network_namespace"} | {"ipc_namespace"}


def test_limits_validation_names_the_field():
    with pytest.raises(ValueError, match="max_processes"):
        SandboxLimits.from_dict({"max_processes": 0})
    with pytest.raises(ValueError, match="network"):
        SandboxLimits.from_dict({"network": "none"})


# -- code reward ---------------------------------------------------------------------------------

def test_extract_program_prefers_the_last_python_block():
    response = "Example:\n```python\nprint(1)\n```\nSolution:\n```python\nprint(2)\n```\n"
    assert extract_program(response) == "print(2)\n"
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"
    assert extract_program("print(4)") == "print(4)"
    assert extract_program("```python\nprint(5)\n") == "print(5)\n"  # truncated generation


@needs_isolation
def test_code_reward_is_all_or_nothing():
    assert code_reward_with_note(f"```python\n{ADD}```", ADD_TESTS, LIMITS) == (
        1.0, "passed (2 tests)")
    half_right = "a, b = map(int, input().split())\nprint(3)\n"
    assert code_reward_with_note(half_right, ADD_TESTS, LIMITS) == (0.0, "wrong output (test 1)")
    outcomes = run_tests(half_right, ADD_TESTS, LIMITS)
    assert [o.passed for o in outcomes] == [True, False]
    with pytest.raises(ValueError, match="tests"):
        code_reward_with_note(ADD, [], LIMITS)
    with pytest.raises(ValueError, match="tests\\[0\\]"):
        code_reward_with_note(ADD, [{"stdin": "1 2"}], LIMITS)


# -- the adversarial suite through the pool ------------------------------------------------------

def sleep_reward(seconds: float) -> float:
    time.sleep(seconds)
    return 1.0


@pytest.fixture(scope="module")
def pool():
    with RewardPool(RewardPoolConfig(num_workers=2, timeout_seconds=POOL_TIMEOUT)) as reward_pool:
        yield reward_pool


def assert_scored_zero_in_time(pool, name, fn, *args):
    outcome, elapsed = timed(f"pool {name}", pool.score_sync, fn, *args)
    assert outcome.score == 0.0, outcome
    assert elapsed < POOL_TIMEOUT + MARGIN_S, f"{name} took {elapsed:.2f}s"
    return outcome


@needs_isolation
@pytest.mark.parametrize("name, program, tests", [
    ("infinite loop", INFINITE_LOOP, ADD_TESTS),
    ("4 GB allocation", ALLOCATE_4GB, [{"input": "", "output": str(4 * 2**30)}]),
    ("100 MB output", HUNDRED_MB_OUTPUT, [{"input": "", "output": "x"}]),
    ("socket to an external IP", connect_program("1.1.1.1", 53), [{"input": "", "output": "3"}]),
])
def test_adversarial_program_scores_zero(pool, name, program, tests):
    outcome = assert_scored_zero_in_time(pool, name, code_reward_with_note, program, tests,
                                         POOL_LIMITS)
    assert outcome.status is RewardStatus.OK  # the sandbox stopped it, not the pool


def test_adversarial_fork_bomb_scores_zero(pool, process_limit_holds):
    assert_scored_zero_in_time(pool, "fork bomb", code_reward_with_note, FORK_BOMB, ADD_TESTS,
                               POOL_LIMITS)
    assert not sandbox_processes()


@needs_isolation
def test_adversarial_socket_to_host_loopback_scores_zero(pool):
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        program = connect_program("127.0.0.1", server.getsockname()[1])
        assert_scored_zero_in_time(pool, "socket to 127.0.0.1", code_reward_with_note, program,
                                   [{"input": "", "output": "3"}], POOL_LIMITS)
        with pytest.raises(BlockingIOError):
            server.accept()


@needs_isolation
def test_adversarial_writes_outside_workdir_score_zero(pool):
    paths = escape_paths()
    assert_scored_zero_in_time(pool, "writes outside the work dir", code_reward_with_note,
                               escape_program(paths), [{"input": "", "output": "3"}], POOL_LIMITS)
    assert not [p for p in paths if os.path.exists(p)]


def test_adversarial_sympy_heavy_expression_times_out(pool):
    # math_verify's own alarm is 5 s, so the pool's 3 s kill is what ends this one.
    outcome = assert_scored_zero_in_time(pool, "sympy-heavy expression", math_answer_reward,
                                         "\\boxed{(x+1)^{10000000}}", "1")
    assert outcome.status is RewardStatus.TIMEOUT


@needs_isolation
def test_worker_killed_mid_sandbox_takes_the_sandbox_with_it(pool):
    # Sandbox wall 30 s > pool timeout: the pool kills the worker while the program still runs.
    patient = POOL_LIMITS.model_copy(update={"wall_seconds": 30.0, "cpu_seconds": 30})
    outcome = assert_scored_zero_in_time(pool, "sleeping program (pool kill)",
                                         code_reward_with_note, SLEEP_FOREVER, ADD_TESTS, patient)
    assert outcome.status is RewardStatus.TIMEOUT
    deadline = time.monotonic() + 30.0  # PDEATHSIG delivery and the namespace teardown are async
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sandbox_processes()
    # and its work dir is gone at once, not at some later sandbox call
    dead = [p for p in Path(tempfile.gettempdir()).glob(f"{sandbox_module.WORKDIR_PREFIX}*-*")
            if not sandbox_module._alive(int(p.name[len(sandbox_module.WORKDIR_PREFIX):]
                                             .split("-", 1)[0]))]
    assert dead == []


def test_hung_python_reward_is_killed(pool):
    outcome = assert_scored_zero_in_time(pool, "hung reward function", sleep_reward, 60.0)
    assert outcome.status is RewardStatus.TIMEOUT


def test_pool_still_scores_after_the_adversarial_suite(pool):
    # Runs last in this file (pytest keeps definition order): every case above has hit this pool.
    assert pool.score_sync(math_answer_reward, "so \\boxed{\\frac{1}{2}}", "0.5").score == 1.0
    if SKIP_REASON is None:
        outcome = pool.score_sync(code_reward_with_note, f"```python\n{ADD}```", ADD_TESTS,
                                  POOL_LIMITS)
        assert (outcome.status, outcome.score) == (RewardStatus.OK, 1.0)
    stats = pool.stats()
    assert stats.timeouts >= 2 and stats.worker_restarts >= stats.timeouts
    assert stats.errors == 0, "no adversarial case should surface as a reward error"
    print("\n[timing] summary:", {k: round(v, 2) for k, v in TIMINGS.items()}, file=sys.stderr)
