"""Code-execution reward: run the model's Python program on each test's stdin, compare stdout.

Scoring is all-or-nothing: 1.0 only when every test passes, else 0.0, and the run stops at the
first failure. Partial credit (fraction passed) rewards programs that special-case the easy tests
and hard-code sample outputs; the binary signal is what most RL-for-code recipes train on, and
stopping early bounds a wrong program's cost at one test instead of all of them.

Each test runs in a fresh sandbox (`asyncrl.reward.sandbox`); a test passes when the program exits
normally and its stdout equals the expected output up to trailing whitespace on each line and
trailing blank lines (judges' usual tolerance). The program is the last ```python fenced block of
the response when there is one (models often show an example first and the solution last), else
the whole response.

Call it through a RewardPool: it blocks for up to wall_seconds per test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.reward.sandbox import (
    SandboxLimits,
    SandboxResult,
    SandboxStatus,
    run_sandboxed,
)

FENCE = re.compile(r"```(?:python|py|python3)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
BARE_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class CaseOutcome:
    passed: bool
    result: SandboxResult


def extract_program(response: str) -> str:
    """The last ```python block, else the last ``` block of any language, else the whole text."""
    for pattern in (FENCE, BARE_FENCE):
        blocks = pattern.findall(response)
        if blocks:
            return blocks[-1]
    return response


def normalize_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


def run_tests(
    program: str, tests: Sequence[Mapping[str, str]], limits: SandboxLimits | None = None,
    stop_at_first_failure: bool = True,
) -> list[CaseOutcome]:
    """Run the extracted program on each {"input", "output"} test; outcomes in test order."""
    code = extract_program(program)
    outcomes = []
    for index, test in enumerate(tests):
        if "input" not in test or "output" not in test:
            raise ValueError(f"tests[{index}] keys={sorted(test)}: need 'input' and 'output'")
        result = run_sandboxed(code, str(test["input"]), limits)
        passed = result.status is SandboxStatus.OK and (
            normalize_output(result.stdout) == normalize_output(str(test["output"]))
        )
        outcomes.append(CaseOutcome(passed, result))
        if not passed and stop_at_first_failure:
            break
    return outcomes


def row_tests(row: Mapping[str, Any], field: str = "tests") -> list[dict[str, str]]:
    """The {"input", "output"} tests in `row[field]`: a list of them, that list as JSON, or the
    APPS / TACO `{"inputs": [...], "outputs": [...]}` form (a dict or its JSON)."""
    if field not in row:
        raise ValueError(f"row id={row.get('id')!r} has no {field!r} field for the code reward "
                         f"(reward.tests_field); its fields: {sorted(row)}")
    value = row[field]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"row id={row.get('id')!r}: {field} is a string but not JSON: "
                             f"{err}") from None
    if isinstance(value, Mapping) and "inputs" in value and "outputs" in value:
        if len(value["inputs"]) != len(value["outputs"]):
            raise ValueError(f"row id={row.get('id')!r}: {field} has {len(value['inputs'])} "
                             f"inputs but {len(value['outputs'])} outputs")
        value = [{"input": i, "output": o} for i, o in zip(value["inputs"], value["outputs"])]
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        raise ValueError(f"row id={row.get('id')!r}: {field}={str(value)[:200]!r}; expected a "
                         "list of {'input', 'output'} or {'inputs': [...], 'outputs': [...]}")
    return [{"input": _as_text(t.get("input")), "output": _as_text(t.get("output"))}
            for t in value]


def _as_text(value: Any) -> str:
    # APPS stores some stdin / stdout as lists of lines
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return "" if value is None else str(value)


def code_reward_with_note(program: str, tests: Sequence[Mapping[str, str]],
                          limits: SandboxLimits | None = None) -> tuple[float, str]:
    """1.0 when the program passes every test, else 0.0 (see the module docstring for why), with a
    note saying how the first failing test ended (for the log and `RewardOutcome.note`):
    "passed (3 tests)", "wrong output (test 1)", "timeout (test 0)"."""
    if not tests:
        raise ValueError("tests=[]: need at least one {'input': ..., 'output': ...} test")
    outcomes = run_tests(program, tests, limits)
    for index, outcome in enumerate(outcomes):
        if not outcome.passed:
            how = ("wrong output" if outcome.result.status is SandboxStatus.OK
                   else outcome.result.status.value)
            return 0.0, f"{how} (test {index})"
    return 1.0, f"passed ({len(tests)} tests)"
