"""The calls vLLM and SGLang adapters make for weights by broadcast: join the trainer's group,
receive one update, recover from a failed one (what the servers accept is cited in each adapter's
docstring; vLLM's parsers are exercised live by tests/integration/test_vllm_weight_transfer.py).
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.api import WeightUpdateKind, WeightUpdateMeta
from asyncrl.inference.backend_protocol import GroupJoin, HttpCall, WireTensor
from asyncrl.inference.sglang_backend import SGLangBackend
from asyncrl.inference.vllm_backend import VLLMBackend

JOIN = GroupJoin(master_addr="10.0.0.5", master_port=29511, world_size=5, rank_offset=3,
                 group_name="policy_sync", backend="nccl")
TENSORS = [WireTensor("model.embed_tokens.weight", (128, 64), "bfloat16"),
           WireTensor("model.norm.weight", (64,), "float32")]


def test_vllm_join_is_its_weight_transfer_init_unpacked():
    call = VLLMBackend().join_group_call(JOIN)
    assert call == HttpCall("POST", "/init_weight_transfer_engine", json={"init_info": {
        "master_address": "10.0.0.5", "master_port": 29511, "rank_offset": 3, "world_size": 5,
        "packed": False}})


def test_vllm_refuses_gloo_groups():
    with pytest.raises(ValueError, match="'gloo' is not offered by vLLM"):
        VLLMBackend().join_group_call(GroupJoin("127.0.0.1", 1, 2, 1, "g", "gloo"))


def test_vllm_update_is_start_update_finish_with_version_then_cache_reset():
    calls = VLLMBackend().distributed_update_calls(JOIN, TENSORS, 7)
    assert [(c.method, c.path) for c in calls] == [
        ("POST", "/start_weight_update"), ("POST", "/update_weights"),
        ("POST", "/finish_weight_update"), ("POST", "/reset_prefix_cache")]
    assert calls[1].json == {"update_info": {
        "names": ["model.embed_tokens.weight", "model.norm.weight"],
        "dtype_names": ["bfloat16", "float32"], "shapes": [[128, 64], [64]]}}
    assert calls[2].json == {"weight_version": "7"}
    # the version it sets is the one the health probe reads back
    assert VLLMBackend().parse_health({"weight_version": "7"}) == 7


def test_vllm_recovery_reopens_and_closes_a_session_without_a_version():
    calls = VLLMBackend().failed_update_recovery_calls()
    assert calls == [HttpCall("POST", "/start_weight_update"),
                     HttpCall("POST", "/finish_weight_update")]


def test_vllm_ranks_per_server_is_its_world_size():
    backend = VLLMBackend()
    assert backend.ranks_call() == HttpCall("GET", "/get_world_size")
    assert backend.parse_ranks({"world_size": 4}) == 4
    with pytest.raises(Exception, match="world_size"):
        backend.parse_ranks({"error": "x"})


def test_sglang_join_names_group_and_backend():
    backend = SGLangBackend()
    call = backend.join_group_call(JOIN)
    assert call == HttpCall("POST", "/init_weights_update_group", json={
        "master_address": "10.0.0.5", "master_port": 29511, "rank_offset": 3, "world_size": 5,
        "group_name": "policy_sync", "backend": "nccl"})
    gloo = backend.join_group_call(GroupJoin("127.0.0.1", 1, 2, 1, "g", "gloo"))
    assert gloo.json["backend"] == "gloo"
    with pytest.raises(ValueError, match="'mpi' is not known"):
        backend.join_group_call(GroupJoin("127.0.0.1", 1, 2, 1, "g", "mpi"))


def test_sglang_update_runs_in_a_session_and_names_the_joined_group():
    backend = SGLangBackend()
    calls = backend.distributed_update_calls(JOIN, TENSORS, 3)
    assert [(c.method, c.path) for c in calls] == [
        ("POST", "/begin_weight_update"), ("POST", "/update_weights_from_distributed"),
        ("POST", "/end_weight_update")]
    assert calls[1].json == {
        "names": ["model.embed_tokens.weight", "model.norm.weight"],
        "dtypes": ["bfloat16", "float32"], "shapes": [[128, 64], [64]],
        "group_name": "policy_sync", "flush_cache": True, "weight_version": "3"}
    assert "load_format" not in calls[1].json  # per tensor, not a flattened bucket
    assert backend.parse_health({"weight_version": "3"}) == 3
    assert backend.failed_update_recovery_calls() == [
        HttpCall("POST", "/end_weight_update", json={})]


def test_layouts_name_the_trainer_side_each_server_needs():
    assert SGLangBackend.broadcast_layout == "per_tensor"
    assert VLLMBackend.broadcast_layout == "vllm_per_tensor"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only host")
def test_vllm_sender_refuses_without_cuda_before_touching_vllm():
    from asyncrl.inference.vllm_weight_transfer import VLLMWeightSender

    meta = WeightUpdateMeta(kind=WeightUpdateKind.DISTRIBUTED, version=1, world_size=2,
                            backend="nccl")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        VLLMWeightSender(meta, {"w": torch.zeros(2)}, connect=False)
    gloo = WeightUpdateMeta(kind=WeightUpdateKind.DISTRIBUTED, version=1, world_size=2,
                            backend="gloo")
    with pytest.raises(ValueError, match="'gloo' is not offered"):
        VLLMWeightSender(gloo, {"w": torch.zeros(2)}, connect=False)
