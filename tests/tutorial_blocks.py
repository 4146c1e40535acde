"""The fenced code blocks of the documentation's tutorials (docs/tutorials/*.md), and how a test
runs each: tests/test_tutorials.py.

A block runs as written. An HTML comment on the line right above its fence says otherwise:

- `<!-- test: skip: REASON -->`: not run; the reason is required (a GPU, a cluster, a hub model,
  a path on the reader's machine, an install).
- `<!-- test: over configs/X.yaml -->` (yaml): the block is a fragment of a run config, checked by
  loading it over that config (default configs/train_tiny.yaml): every field exists, every value
  is allowed.
- `<!-- test: with KEY=VALUE ... -->`: each `asyncrl train` command of a bash block gets these
  overrides appended; a python block gets them as its command-line arguments (a short run: a few
  steps, a random tiny model as `model.path=$TINY`). `$NAME` in a block or in its overrides reads
  the environment the test sets (TINY, TINY_VL, TINY_MOE: random tiny model directories of the
  presets tiny, tiny-vl, tiny-moe; DATA: a JSONL file of 100 sums, question and answer; OUT: a
  scratch directory).

python blocks run as scripts, bash blocks with `bash -euo pipefail`, each in a scratch directory
that holds the repository's configs/ and examples/ (the package and examples importable).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "docs" / "tutorials"
FENCE = re.compile(r"(?:<!-- test: (?P<directive>.*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```",
                   re.S)


@dataclass(frozen=True)
class Block:
    page: str  # the tutorial's file name
    index: int  # the block's place on its page (1-based)
    lang: str
    code: str
    directive: str | None

    @property
    def id(self) -> str:
        return f"{self.page}#{self.index}-{self.lang or 'text'}"

    @property
    def skip_reason(self) -> str | None:
        if self.directive and self.directive.startswith("skip"):
            return self.directive.partition(":")[2].strip()
        return None

    @property
    def base_config(self) -> str:
        if self.directive and self.directive.startswith("over "):
            return self.directive.removeprefix("over ").strip()
        return "configs/train_tiny.yaml"

    @property
    def overrides(self) -> list[str]:
        if self.directive and self.directive.startswith("with "):
            return self.directive.removeprefix("with ").split()
        return []


def blocks() -> list[Block]:
    out = []
    for path in sorted(TUTORIALS.glob("*.md")):
        for i, m in enumerate(FENCE.finditer(path.read_text()), 1):
            out.append(Block(path.name, i, m["lang"], m["code"], m["directive"]))
    return out


def with_overrides(code: str, overrides: list[str]) -> str:
    """`code` with `overrides` appended to each `asyncrl train` command (a line's last command;
    a continued line's end)."""
    if not overrides:
        return code
    lines, out = code.split("\n"), []
    for i, line in enumerate(lines):
        body = line.split("  #")[0].rstrip()
        continued = body.endswith("\\")
        in_train = any("asyncrl train" in prev for prev in _command_lines(lines, i))
        if in_train and not continued and body:
            line = f"{body} {' '.join(overrides)}"
        out.append(line)
    return "\n".join(out)


def _command_lines(lines: list[str], i: int) -> list[str]:
    """Line i and the continued lines before it (one shell command)."""
    start = i
    while start > 0 and lines[start - 1].split("  #")[0].rstrip().endswith("\\"):
        start -= 1
    return lines[start:i + 1]
