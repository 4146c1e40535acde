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
    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[int, IO[str]] = {}

    def write(self, traj: Trajectory, data: dict[str, Any], start_version: int) -> None:
        f = self._files.get(start_version)
        if f is None:
            f = self._files[start_version] = open(self.dir / f"v{start_version:06d}.jsonl", "a")
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
            f.write(json.dumps(record) + "\n")
        f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
