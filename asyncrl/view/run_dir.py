"""Reading run directories for `asyncrl view`, while they are written and when they are damaged.

Everything here reads what `asyncrl train` writes (launch/run_logger.py, launch/run_events.py,
launch/step_samples.py) and never writes. JSONL files are read from a byte offset and only up to
their last complete line, so a line being written is picked up on the next poll; a line that is
not a JSON object is reported (file, line, what is wrong) and skipped; a file shorter than the
offset a reader holds (a resumed run cut its metrics back) tells the reader to start again.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.launch.run_events import EVENTS_FILE, EventKind
from asyncrl.launch.run_logger import METRICS_FILE
from asyncrl.launch.step_samples import IMAGES_DIR, SAMPLES_DIR

CONFIG_FILE = "config.yaml"
RUN_MARKERS = (METRICS_FILE, EVENTS_FILE, CONFIG_FILE)
STEP_FILE = re.compile(r"step_(\d{6,})\.jsonl")
IMAGE_FILE = re.compile(r"[0-9a-zA-Z]{1,128}_\d{1,4}\.png")
LIVE_S = 120.0  # a run whose files changed this recently, with no stop recorded, is running


class RunProblem(Exception):
    """What the page shows instead of data: a missing run, step or file, said in one line."""

    def __init__(self, message: str, status: int = 404) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Lines:
    rows: list[dict[str, Any]] = field(default_factory=list)
    offset: int = 0  # bytes read: the next call starts here
    reset: bool = False  # the file is shorter than the offset asked for: rows are from byte 0
    problems: list[str] = field(default_factory=list)
    partial_tail: bool = False  # the file ends inside a line (being written, or cut by a crash)


def read_lines(path: Path, offset: int = 0) -> Lines:
    """The complete JSON-object lines of `path` from byte `offset` (a missing file: none)."""
    if not path.is_file():
        return Lines(offset=0, reset=offset > 0)
    size = path.stat().st_size
    out = Lines()
    if offset > size:
        offset, out.reset = 0, True
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size - offset)
    end = data.rfind(b"\n") + 1
    out.offset, out.partial_tail = offset + end, end < len(data)
    for number, line in enumerate(data[:end].split(b"\n")[:-1]):
        if not line.strip():
            continue
        where = f"{path.name} line {number + 1}" + (f" after byte {offset}" if offset else "")
        try:
            row = json.loads(line)
        except ValueError as err:
            out.problems.append(f"{where} is not JSON ({err}); skipped: {line[:80]!r}")
            continue
        if not isinstance(row, dict):
            out.problems.append(f"{where} is a JSON {type(row).__name__}, not an object; skipped")
            continue
        out.rows.append(row)
    return out


def is_run(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in RUN_MARKERS)


def find_runs(root: Path) -> dict[str, Path]:
    """The runs `asyncrl view ROOT` shows by name: ROOT itself when it is a run, else the runs
    up to two levels below it (`runs/job`, `runs/sweep/job`)."""
    if not root.is_dir():
        raise RunProblem(f"{root} is not a directory: give a run directory (the output_dir of "
                         "asyncrl train) or a directory holding runs")
    if is_run(root):
        return {root.name: root}
    found = {}
    for child in sorted(p for p in root.iterdir() if p.is_dir()):
        if is_run(child):
            found[child.name] = child
        else:
            for sub in sorted(p for p in child.iterdir() if p.is_dir()):
                if is_run(sub):
                    found[f"{child.name}/{sub.name}"] = sub
    return found


class RunDir:
    """One run directory, read on demand (nothing cached: the run may be writing)."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path

    def status(self) -> dict[str, Any]:
        """Whether the run is running, finished or failed, as far as its files tell."""
        files = [self.path / f for f in RUN_MARKERS if (self.path / f).is_file()]
        updated = max((f.stat().st_mtime for f in files), default=None)
        age = None if updated is None else max(0.0, time.time() - updated)
        events = read_lines(self.path / EVENTS_FILE).rows
        last = next((e for e in reversed(events) if e.get("kind") in
                     (EventKind.STOP.value, EventKind.ERROR.value, EventKind.START.value,
                      EventKind.RESUME.value)), None)
        if last is not None and last.get("kind") == EventKind.STOP.value:
            state, detail = "finished", str(last.get("message", ""))
        elif last is not None and last.get("kind") == EventKind.ERROR.value:
            state, detail = "failed", str(last.get("message", ""))
        elif age is not None and age < LIVE_S:
            state, detail = "running", "files updated in the last two minutes"
        else:
            state = "stopped"
            detail = ("no stop recorded and no file updated for a while: the run was killed, "
                      "or it predates events.jsonl")
        if not (self.path / METRICS_FILE).is_file():
            detail += f"; no {METRICS_FILE} yet (the run writes it after its first step)"
        return {"name": self.name, "path": str(self.path), "state": state, "detail": detail,
                "updated_s_ago": age, "sample_steps": len(self.sample_steps())}

    def metrics(self, offset: int = 0) -> Lines:
        lines = read_lines(self.path / METRICS_FILE, offset)
        good = [r for r in lines.rows if isinstance(r.get("step"), (int, float))]
        if len(good) < len(lines.rows):
            lines.problems.append(f"{len(lines.rows) - len(good)} line(s) of {METRICS_FILE} "
                                  "have no numeric 'step'; skipped")
            lines.rows = good
        return lines

    def events(self, offset: int = 0) -> Lines:
        return read_lines(self.path / EVENTS_FILE, offset)

    def sample_steps(self) -> list[int]:
        folder = self.path / SAMPLES_DIR
        if not folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in folder.iterdir()
                      if (m := STEP_FILE.fullmatch(p.name)))

    def samples(self, step: int) -> Lines:
        steps = self.sample_steps()
        if step not in steps:
            around = (f"recorded steps: {steps[0]}-{steps[-1]} ({len(steps)})" if steps else
                      f"this run recorded no samples ({SAMPLES_DIR}/ is empty or missing: "
                      "logging.sample_groups=0, or the run predates it)")
            raise RunProblem(f"no samples of step {step} in run {self.name}; {around}")
        lines = read_lines(self.path / SAMPLES_DIR / f"step_{step:06d}.jsonl")
        good = []
        for row in lines.rows:
            missing = [k for k in ("tokens", "versions", "loss_mask") if
                       not isinstance(row.get(k), list)]
            if missing:
                lines.problems.append(f"a sample of step {step} lacks {', '.join(missing)}; "
                                      "skipped")
            else:
                good.append(row)
        lines.rows = good
        if lines.partial_tail:
            lines.problems.append(f"step_{step:06d}.jsonl ends inside a line (cut while being "
                                  "written); the samples before it are shown")
        return lines

    def image(self, name: str) -> Path:
        if not IMAGE_FILE.fullmatch(name):
            raise RunProblem(f"{name!r} is not an image name of this run", 400)
        path = self.path / SAMPLES_DIR / IMAGES_DIR / name
        if not path.is_file():
            raise RunProblem(f"run {self.name} has no image {name}")
        return path
