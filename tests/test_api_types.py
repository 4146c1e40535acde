"""Data-type invariants of asyncrl.api: validation and alignment of per-token fields."""

import pytest

from asyncrl.api import (
    GenerationConfig,
    ModelRequest,
    ModelResponse,
    Sample,
    StopReason,
    Trajectory,
    WeightUpdateKind,
    WeightUpdateMeta,
)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"n_samples": 0}, "n_samples"),
        ({"top_k": -1}, "top_k"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_generation_config_rejects_out_of_range(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GenerationConfig(**kwargs)


def test_temperature_zero_means_greedy():
    assert GenerationConfig(temperature=0.0).greedy
    assert not GenerationConfig(temperature=0.5).greedy
    assert GenerationConfig().replace(n_samples=4).n_samples == 4


def test_request_and_response_validation():
    with pytest.raises(ValueError, match="empty"):
        ModelRequest(input_ids=[])
    a, b = ModelRequest(input_ids=[1]), ModelRequest(input_ids=[1])
    assert a.rid != b.rid
    with pytest.raises(ValueError, match="lengths differ"):
        ModelResponse([1], [2, 3], [0.0], [0, 0], StopReason.STOP)
    r = ModelResponse([1, 2], [3], [-0.5], [7], StopReason.LENGTH)
    assert (r.input_len, r.output_len) == (2, 1)


def test_sample_from_prompt_and_completion_aligns_fields():
    s = Sample.from_prompt_and_completion([5, 6, 7], [8, 9], [-0.1, -0.2], [3, 4], reward=1.0)
    assert s.input_ids == [5, 6, 7, 8, 9]
    assert s.loss_mask == [0, 0, 0, 1, 1]
    assert s.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2]
    assert s.versions == [-1, -1, -1, 3, 4]
    assert (s.head_version, s.tail_version, s.num_generated) == (3, 4, 2)
    assert not s.truncated
    traj = Trajectory([s, Sample.from_prompt_and_completion([1], [2], [-1.0], [2])])
    assert traj.head_version == 2 and traj.rewards == [1.0, 0.0] and len(traj) == 2


def test_sample_rejects_misaligned_or_unversioned_tokens():
    with pytest.raises(ValueError, match="loss_mask"):
        Sample([1, 2], [0], [0.0, 0.0], [-1, -1])
    with pytest.raises(ValueError, match="version -1"):
        Sample([1, 2], [0, 1], [0.0, -0.3], [-1, -1])
    with pytest.raises(ValueError, match="empty"):
        Trajectory([])


def test_weight_update_meta():
    assert WeightUpdateMeta.from_disk("/tmp/w", 3).kind is WeightUpdateKind.DISK
    with pytest.raises(ValueError, match="path"):
        WeightUpdateMeta(kind=WeightUpdateKind.DISK, version=1)
    with pytest.raises(ValueError, match="world_size"):
        WeightUpdateMeta(kind=WeightUpdateKind.DISTRIBUTED, version=1, world_size=1)
    with pytest.raises(ValueError, match="version"):
        WeightUpdateMeta.from_tensors(-1)
