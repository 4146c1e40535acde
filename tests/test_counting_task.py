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
    with pytest.raises(ConfigError, match=r"inference.backend='sglang' sends no images to its "
                                          r"servers; allowed: \['vllm'\]"):
        TrainRunConfig.from_dict({**base, "inference": {"mode": "local", "backend": "sglang"}})
    local_vllm = {**base, "inference": {"mode": "local", "backend": "vllm"}}
    assert TrainRunConfig.from_dict(local_vllm).inference.backend.kind == "vllm"


def test_clevr_count_layout_loads_from_the_hub_cache_with_its_images(tmp_path, monkeypatch):
    """CLEVR-Count-70K's layout (images: a list of Image, problem with an <image> mark, answer)
    in a hub cache laid out as huggingface_hub does, read offline by `kind: hf`; the rows encode
    for the tiny VLM with their images."""
    import datasets
    from PIL import Image

    from asyncrl.models.presets import build_preset_model
    from asyncrl.models.vision import VisionPromptEncoder, load_image

    snap = tmp_path / "hub" / "datasets--org--clevr_count" / "snapshots" / ("c" * 40)
    (snap / "data").mkdir(parents=True)
    features = datasets.Features({"images": datasets.Sequence(datasets.Image()),
                                  "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    colours = ["red", "green", "blue", "gray"]
    for split, n in (("train", 6), ("test", 2)):
        table = datasets.Dataset.from_dict({
            "images": [[Image.new("RGB", (64 + 8 * i, 64), colours[i % 4])] for i in range(n)],
            "problem": ["<image>How many items are there in the image?"] * n,
            "answer": [str(i + 1) for i in range(n)]}, features=features)
        table.to_parquet(str(snap / "data" / f"{split}-00000-of-00001.parquet"))
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("c" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    rows = parse_dataset_config({"kind": "hf", "name": "org/clevr_count", "split": "train",
                                 "eval_split": "test", "question_field": "problem"}).build()
    train = rows.train_rows()
    assert [r["answer"] for r in train] == ["1", "2", "3", "4", "5", "6"]
    first = train[0]
    assert first["question"] == "How many items are there in the image?"
    assert first["messages"] == [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "How many items are there in the image?"}]}]
    # the Image column's values as the table holds them ({"bytes", "path"}), decoded on use
    assert len(first["images"]) == 1 and load_image(first["images"][0]).size == (64, 64)
    encoder = VisionPromptEncoder.from_model_dir(build_preset_model("tiny-vl", tmp_path / "vl"))
    prompt = encoder.encode(first["messages"], first["images"])
    assert prompt.num_images == 1 and prompt.input_ids.count(encoder.pad_id) == 4  # 56 px: 2x2


def test_cells_layout_puts_each_object_in_a_cell_of_its_own():
    cfg = CountingTaskConfig(num_train=20, num_eval=0, max_objects=6)
    for row in cfg.build().train_rows():
        cells = {(o["box"][0] // 28, o["box"][1] // 28) for o in row["objects"]}
        assert len(cells) == len(row["objects"]) == int(row["answer"])
        assert all(b[0] // 28 == (b[2] - 1) // 28 and b[1] // 28 == (b[3] - 1) // 28
                   for b in (o["box"] for o in row["objects"]))
    with pytest.raises(ValueError, match="max_objects=12 does not fit the 4 cells"):
        CountingTaskConfig(image_size=56, max_objects=12)
    assert CountingTaskConfig(image_size=56, max_objects=12, layout="free").max_objects == 12


def test_attribute_questions_count_the_matching_objects_of_scenes_that_occlude():
    """The harder variant: questions about a colour, a shape or both, answered by the objects
    drawn; with occlusion, objects overlap by at most that share of the smaller box."""
    import re

    from asyncrl.data.counting import _overlap

    cfg = CountingTaskConfig(questions="attributes", layout="free", occlusion=0.3,
                             max_objects=10, num_train=120, num_eval=0)
    rows = cfg.build().train_rows()
    kinds, overlapped = set(), 0
    for row in rows:
        m = re.fullmatch(r"How many (?:(\w+) )?(\w+)s are there\?", row["question"])
        assert m, row["question"]
        colour, noun = m[1], m[2]
        shape = None if noun == "object" else noun
        kinds.add((colour is not None, shape is not None))
        want = sum((colour is None or o["colour"] == colour) and (shape is None or o["shape"] == shape)
                   for o in row["objects"])
        assert row["answer"] == str(want) and row["messages"][0]["content"][1]["text"] == row["question"]
        boxes = [o["box"] for o in row["objects"]]
        pairs = [_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[:i]]
        assert all(p <= 0.3 for p in pairs)
        overlapped += any(p > 0 for p in pairs)
    assert kinds == {(True, False), (False, True), (True, True)}
    assert overlapped > 10  # occlusion happens
    assert {r["answer"] for r in rows} >= {"0", "1", "2", "3"}
    with pytest.raises(ValueError, match="occlusion=0.2 needs layout 'free'"):
        CountingTaskConfig(occlusion=0.2)
