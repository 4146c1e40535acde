"""What a person looks at to debug a run: a few groups of each training batch, token by token.

`StepSamples.write(step, trajectories, record)` appends the first `logging.sample_groups` groups
of the batch trained at `step` to RUN/samples/step_NNNNNN.jsonl, one sample per line, with what
the trainer knew of each token: the text piece, the policy version that sampled it, the sampler's
logprob and the trainer's (under the weights the step started from; `PPOActor.take_record`), the
advantage, and where a weight update fell inside the generation (consecutive generated tokens of
different versions). Prompt images are written once each under RUN/samples/images/. Size is
bounded by `sample_groups` (the main job: 4 groups of 8 samples, about 40 kB per step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.api import Trajectory
from asyncrl.api.trajectory import Sample

SAMPLES_DIR = "samples"
IMAGES_DIR = "images"


def step_file(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / SAMPLES_DIR / f"step_{step:06d}.jsonl"


def weight_updates(versions: list[int], mask: list[int]) -> list[int]:
    """Indices of generated tokens sampled by a newer policy than the generated token before
    them in the same turn: where a weight update reached an unfinished generation."""
    out = []
    for i in range(1, len(versions)):
        if mask[i] and mask[i - 1] and versions[i] != versions[i - 1]:
            out.append(i)
    return out


def turns(sample: Sample) -> list[dict[str, Any]]:
    """The sample as alternating context / model segments (runs of loss_mask 0 and 1), each
    [start, end) with a model segment's reward (its last token's token reward) when known."""
    out, start, mask = [], 0, sample.loss_mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            seg: dict[str, Any] = {"role": "model" if mask[start] else "context",
                                   "start": start, "end": i}
            if mask[start] and sample.token_rewards is not None:
                seg["reward"] = sample.token_rewards[i - 1]
            out.append(seg)
            start = i
    return out


def _rounded(values: list[float] | None, digits: int = 5) -> list[float] | None:
    return None if values is None else [round(float(v), digits) for v in values]


def sample_record(sample: Sample, pieces: list[str], *, step: int, policy_version: int,
                  group: int, index: int, row_id: Any, trainer_logprobs: list[float] | None,
                  advantages: list[float] | None, images: list[str]) -> dict[str, Any]:
    """One sample's line of the step file (lists aligned with its tokens)."""
    meta = {k: v for k, v in sample.metadata.items()
            if isinstance(v, (str, int, float, bool, list)) and k != "completion_text"}
    return {
        "step": step, "policy_version": policy_version, "group": group, "sample": index,
        "id": row_id,
        "reward": sample.reward, "stop_reason": sample.stop_reason.value,
        "tokens": pieces, "input_ids": sample.input_ids, "loss_mask": sample.loss_mask,
        "versions": sample.versions, "sampler_logprobs": _rounded(sample.logprobs),
        "trainer_logprobs": _rounded(trainer_logprobs), "advantages": _rounded(advantages),
        "weight_updates": weight_updates(sample.versions, sample.loss_mask),
        "turns": turns(sample), "images": images, "metadata": meta,
    }


class StepSamples:
    """Owns RUN/samples/. `decode_pieces(ids)` gives each token's text (the run's tokenizer)."""

    def __init__(self, run_dir: str | Path, groups: int, decode_pieces: Any) -> None:
        if groups < 0:
            raise ValueError(f"sample_groups={groups} is out of range; allowed >= 0")
        self.run_dir, self.groups, self.decode_pieces = Path(run_dir), groups, decode_pieces
        self._saved_images: set[str] = set()

    def write(self, step: int, policy_version: int, trajectories: list[Trajectory],
              record: dict[int, dict[str, list[float]]]) -> Path | None:
        """`policy_version`: the trainer's version the step started from; `record`: the
        trainer's per-token lists by the sample's index in the batch."""
        if not self.groups:
            return None
        path = step_file(self.run_dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines, flat = [], 0
        for g, traj in enumerate(trajectories):
            if g >= self.groups:
                break
            for k, sample in enumerate(traj.samples):
                known = record.get(flat + k, {})
                lines.append(json.dumps(sample_record(
                    sample, self.decode_pieces(sample.input_ids), step=step,
                    policy_version=policy_version, group=g, index=k,
                    row_id=traj.group_id, trainer_logprobs=known.get("trainer_logprobs"),
                    advantages=known.get("advantages"), images=self._images(sample))))
            flat += len(traj.samples)
        with open(path, "w") as f:  # a resumed run rewrites the steps it trains again
            f.write("\n".join(lines) + "\n")
        return path

    def _images(self, sample: Sample) -> list[str]:
        """The prompt's images as files under samples/images/ (written once per content)."""
        images = sample.images
        if images is None or not images.sources:
            return []
        names = [f"{images.digest}_{i}.png" for i in range(len(images.sources))]
        if images.digest not in self._saved_images:
            folder = self.run_dir / SAMPLES_DIR / IMAGES_DIR
            folder.mkdir(parents=True, exist_ok=True)
            for name, img in zip(names, images.sources):
                if not (folder / name).exists():
                    img.save(folder / name, format="PNG")
            self._saved_images.add(images.digest)
        return names
