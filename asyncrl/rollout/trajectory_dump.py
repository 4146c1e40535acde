"""Optional JSONL dump of every accepted trajectory, one file per start version, for inspection.

Each line holds the data id, the answer, rewards, head/tail versions, lengths, the token ids and,
when the workflow put them in the sample metadata, the decoded prompt and completion text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from asyncrl.api import Trajectory


class TrajectoryDump:
    def __init__(self, directory: str, max_open: int = 8) -> None:
        if max_open < 1:
            raise ValueError(f"max_open={max_open} is out of range; allowed [1, inf)")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_open = max_open
        # Only the few newest versions still receive trajectories, so a long run keeps a bounded
        # number of files open (oldest closed first; reopened in append mode if ever needed).
        self._files: dict[int, IO[str]] = {}

    def _file(self, version: int) -> IO[str]:
        f = self._files.get(version)
        if f is None:
            while len(self._files) >= self.max_open:
                self._files.pop(min(self._files)).close()
            f = self._files[version] = open(self.dir / f"v{version:06d}.jsonl", "a")
        return f

    def write(self, traj: Trajectory, data: dict[str, Any], start_version: int) -> None:
        f = self._file(start_version)
        for i, s in enumerate(traj.samples):
            record = {
                "id": data.get("id"), "sample": i, "group_id": traj.group_id,
                "answer": data.get("answer"), "reward": s.reward,
                "start_version": start_version, "head_version": s.head_version,
                "tail_version": s.tail_version, "num_tokens": len(s.input_ids),
                "num_generated": s.num_generated, "stop_reason": s.stop_reason.value,
                "input_ids": s.input_ids, "loss_mask": s.loss_mask,
                **{k: v for k, v in s.metadata.items() if k in ("prompt_text", "completion_text")},
            }
            if s.images is not None:  # which images the prompt held (their content hash)
                record["image_digest"] = s.images.digest
            f.write(json.dumps(record) + "\n")
        f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
