"""Overlapped decode steps (`inference.engine.overlap_steps`, the CUDA default) against the
sequential engine on the CPU in fp32: the next decode launches from the previous step's tokens
still on the device, before the host reads them. Same tokens, versions and stop reasons, logprobs
within 1e-5 (a stopped sequence keeps its row one step longer, so batches differ and fp32 matmuls
are not batch-invariant), for every architecture, on the shape-following and the static-shape
decode, with sequences stopping on stop tokens (one under min_new_tokens) and at their lengths,
and a weight update landing mid-generation (it waits for the step in flight, whose tokens keep
the old version).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from decode_paths import ARCHS, built, drive  # noqa: F401 (built: a fixture)

from asyncrl.api import GenerationConfig, ModelRequest
from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.inference.model_runner import StaticDecode

pytestmark = pytest.mark.usefixtures("one_thread")


def engine(path, overlap: bool, static: bool = False) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model_path=str(path), max_seq_len=64, device="cpu",
                                 max_num_seqs=8, backend="native", cpu_kernels=False,
                                 overlap_steps=overlap))
    eng.runner.static = StaticDecode(8, 64, eng.runner.device) if static else None
    return eng


@pytest.mark.parametrize("static", [False, True], ids=["shapes", "static"])
@pytest.mark.parametrize("name", ARCHS)
def test_overlapped_steps_equal_sequential_steps(name, static, built):
    path, model = built[name]
    ref = drive(engine(path, False, static), model, stop_tokens=True)
    eng = engine(path, True, static)
    assert eng.overlap
    got = drive(eng, model, stop_tokens=True)
    assert ref.keys() == got.keys() == {str(i) for i in range(5)}
    assert any(o.stop_reason.value == "stop" for o in ref.values())  # a stop token ended one
    for rid, out in ref.items():
        assert got[rid].output_tokens == out.output_tokens, rid
        assert got[rid].output_versions == out.output_versions, rid
        assert got[rid].stop_reason == out.stop_reason, rid
        torch.testing.assert_close(torch.tensor(got[rid].output_logprobs),
                                   torch.tensor(out.output_logprobs), atol=1e-5, rtol=0)
    assert eng._launched is None and not eng.has_unfinished()


def test_an_update_waits_for_the_step_in_flight(built):
    """A step is launched (tokens on the device, not read); the update first finishes it: its
    tokens get the old version, and a request it finished is handed out by the next step."""
    path, model = built["qwen3"]
    eng = engine(path, True)
    eng.add_request(ModelRequest([5, 6, 7], GenerationConfig(max_new_tokens=3, seed=0), rid="a"))
    eng.add_request(ModelRequest([8, 9], GenerationConfig(max_new_tokens=9, seed=1), rid="b"))
    eng.step()  # prefill: 1 token each
    eng.step()  # a decode launched, not read
    assert eng._launched is not None
    eng.step()  # the next launched; the previous read: 2 tokens each
    eng.update_weights_from_state_dict(model.state_dict(), version=1)
    assert eng._launched is None
    finished = eng.step()  # "a" reached 3 tokens in the step the update finished
    assert [o.rid for o in finished] == ["a"] and finished[0].output_versions == [0, 0, 0]
    rest = []
    while eng.has_unfinished():
        rest += eng.step()
    assert rest[0].output_versions[:3] == [0, 0, 0] and set(rest[0].output_versions[3:]) == {1}


def test_the_async_engine_pauses_and_resumes_with_a_step_in_flight(built):
    """Through AsyncLLMEngine: a pause (which aborts) finishes the step in flight first; every
    request gets its answer, and after `resume` new requests run to their length."""
    path, _ = built["qwen3"]

    async def go():
        eng = AsyncLLMEngine(engine(path, True))
        try:
            tasks = [asyncio.ensure_future(eng.agenerate(ModelRequest(
                [5, 6, 7 + i], GenerationConfig(max_new_tokens=50, seed=i), rid=str(i))))
                for i in range(3)]
            while not any(len(s.output_tokens) > 2 for s in eng.engine.scheduler.running):
                await asyncio.sleep(0.001)
            eng.pause()
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert {o.stop_reason.value for o in outs} <= {"abort", "length"}
            versions = [v for o in outs for v in o.output_versions]
            assert versions and set(versions) == {0}
            eng.resume()
            out = await asyncio.wait_for(eng.agenerate(ModelRequest(
                [9, 9], GenerationConfig(max_new_tokens=5, seed=0), rid="z")), 60)
            assert len(out.output_tokens) == 5
        finally:
            eng.shutdown()

    asyncio.run(go())
