"""The training job on a vision-language model: `asyncrl`'s Trainer with the embedded tiny VLM
(`build-model --preset tiny-vl`) and the counting task (rows with images) runs rollouts with the
images on the in-process engine, trains on them, evaluates and checkpoints, and a resume
continues from the checkpoint. (Learning to count within minutes needs the SFT warm start of a
later step; this checks the path, not the accuracy.)"""

from __future__ import annotations

import json

import pytest
from test_train_loop import metrics, small_config

from asyncrl import Trainer
from asyncrl.models.presets import build_preset_model


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_preset_model("tiny-vl", tmp_path_factory.mktemp("tiny-vl"))


def counting_config(vl_dir, out, **over):
    return small_config(vl_dir, out, **{"data": {"kind": "counting", "num_train": 64,
                                                 "num_eval": 8, "max_objects": 4},
                                        "gconfig.max_new_tokens": 3, **over})


def test_a_vlm_trains_on_images_and_resumes(vl_dir, tmp_path):
    run = tmp_path / "run"
    result = Trainer(counting_config(vl_dir, run)).train()
    assert result.steps == 3 and result.final_accuracy is not None
    steps = [m for m in metrics(run) if "perf/train_s" in m]
    assert len(steps) == 3 and all(m["batch/tokens"] > 0 for m in steps)
    dumped = [json.loads(line) for f in sorted((run / "rollouts").glob("*.jsonl"))
              for line in f.read_text().splitlines()]
    assert dumped and all(d["answer"].isdigit() and len(d["image_digest"]) == 16 for d in dumped)
    assert (run / "checkpoints" / "latest").exists()
    resumed = Trainer(counting_config(vl_dir, run, total_steps=4)).train(resume=True)
    assert resumed.steps == 4
