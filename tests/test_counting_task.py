"""The embedded counting task (`data: {kind: counting}`): deterministic rendered scenes whose
answer is the number of shapes drawn, and the run config refusing what cannot train on images."""

from __future__ import annotations

import random

import pytest

from asyncrl.config import ConfigError
from asyncrl.data.counting import CountingTaskConfig, render_scene
from asyncrl.data.dataset import parse_dataset_config
from asyncrl.launch.train_config import TrainRunConfig


def test_scenes_are_deterministic_and_hold_the_counted_objects():
    cfg = parse_dataset_config({"kind": "counting", "num_train": 50, "num_eval": 10})
    assert isinstance(cfg, CountingTaskConfig)
    first, again = cfg.build(), cfg.build()
    for a, b in zip(first.train_rows() + first.eval_rows(), again.train_rows() + again.eval_rows()):
        assert a["images"][0].tobytes() == b["images"][0].tobytes() and a["answer"] == b["answer"]
    rows = first.train_rows()
    assert {r["id"] for r in rows}.isdisjoint(r["id"] for r in first.eval_rows())
    assert {int(r["answer"]) for r in rows} == set(range(1, 7))  # the default 1..6
    for r in rows:
        assert int(r["answer"]) == len(r["objects"])
        assert r["images"][0].size == (112, 112)
        assert r["messages"][0]["content"][0] == {"type": "image"}
        boxes = [o["box"] for o in r["objects"]]
        for i, a in enumerate(boxes):  # apart: every object is countable
            for b in boxes[i + 1:]:
                assert a[2] < b[0] or b[2] < a[0] or a[3] < b[1] or b[3] < a[1]
    # the held-out scenes do not move when the training set grows
    bigger = CountingTaskConfig(num_train=80, num_eval=10).build()
    assert [r["answer"] for r in bigger.eval_rows()] == [r["answer"] for r in first.eval_rows()]


def test_a_scene_that_cannot_fit_is_a_clear_error():
    with pytest.raises(ValueError, match="do not fit apart"):
        render_scene(random.Random(0), 200, 56)
    with pytest.raises(ConfigError, match="min_objects=5 > max_objects=3"):
        parse_dataset_config({"kind": "counting", "min_objects": 5, "max_objects": 3})


def test_image_data_is_refused_with_what_cannot_take_images(tmp_path):
    from asyncrl.models.presets import build_preset_model

    with pytest.raises(ConfigError, match="is a text-only model"):
        TrainRunConfig.from_dict({"data": {"kind": "counting"}})
    vl = str(build_preset_model("tiny-vl", tmp_path / "vl"))
    base = {"data": {"kind": "counting"}, "model": {"path": vl}}
    assert TrainRunConfig.from_dict(base).data.kind == "counting"
    with pytest.raises(ConfigError, match="workflow.kind='multi_turn' does not pass images"):
        TrainRunConfig.from_dict({**base, "workflow": {"kind": "multi_turn"}})
    with pytest.raises(ConfigError, match="inference.mode='local' does not send images"):
        TrainRunConfig.from_dict({**base, "inference": {"mode": "local"}})
