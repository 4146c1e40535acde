"""Static-shape decode (model_runner.StaticDecode, the CUDA default) against the engine's
shape-following decode on the CPU in fp32: batches rounded up to powers of two, attended lengths
likewise, padding rows in free slots. Same tokens, same versions and logprobs within 1e-5 for
every architecture, with sequences finishing at different steps (the running set re-compacts) and
a weight update landing mid-generation. Not to the bit: fp32 matmuls are not batch-invariant (a
sequence's logprobs from the shape-following decode already differ in the last bits when the
batch around it changes), and the differences here are of that size. (The CUDA default itself
runs in the gpu-marked tests.)
"""

from __future__ import annotations

import pytest
import torch

from decode_paths import ARCHS, built, drive  # noqa: F401 (built: a fixture)

from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.inference.model_runner import StaticDecode, bucket

pytestmark = pytest.mark.usefixtures("one_thread")


def run(path, model, static: bool, cpu_kernels: bool):
    eng = LLMEngine(EngineConfig(model_path=str(path), max_seq_len=64, device="cpu",
                                 max_num_seqs=8, backend="native", cpu_kernels=cpu_kernels))
    eng.runner.static = StaticDecode(8, 64, eng.runner.device) if static else None
    return drive(eng, model)


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("name", ARCHS)
def test_static_shapes_equal_the_shape_following_decode(name, cpu_kernels, built):
    path, model = built[name]
    ref = run(path, model, False, cpu_kernels)
    got = run(path, model, True, cpu_kernels)
    assert ref.keys() == got.keys() == {str(i) for i in range(5)}
    for rid, out in ref.items():
        assert got[rid].output_tokens == out.output_tokens
        assert got[rid].output_versions == out.output_versions
        assert 1 in out.output_versions[1:] or len(out.output_tokens) <= 8
        torch.testing.assert_close(torch.tensor(got[rid].output_logprobs),
                                   torch.tensor(out.output_logprobs), atol=1e-5, rtol=0)


def test_buckets_are_powers_of_two_within_the_cap():
    assert [bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 33, 64, 65)] == [1, 2, 4, 8, 8, 16, 64, 64,
                                                                       64]
    assert bucket(5, 6) == 6


def run_cuda(path, model, graphs: bool):
    """`drive` on CUDA in bf16, with or without graphs."""
    eng = LLMEngine(EngineConfig(model_path=str(path), max_seq_len=64, device="cuda",
                                 dtype="bfloat16", max_num_seqs=8, backend="native",
                                 cuda_graphs=graphs))
    return drive(eng, model), eng.runner.static


@pytest.mark.gpu
@pytest.mark.parametrize("name", ARCHS)
def test_cuda_graphs_replay_the_eager_static_steps(name, built):
    """On a GPU: graphs captured per bucket, replayed across a weight update, give the eager
    static path's tokens and versions, logprobs within bf16 rounding (and the update reaches
    the replayed graphs: versions split, logprobs follow the new weights)."""
    path, model = built[name]
    eager, _ = run_cuda(path, model, False)
    graphed, static = run_cuda(path, model, True)
    assert static.graphs and all(g is not None for g in static.graphs.values())
    for rid, out in eager.items():
        assert graphed[rid].output_versions == out.output_versions
        assert graphed[rid].output_tokens == out.output_tokens
        torch.testing.assert_close(torch.tensor(graphed[rid].output_logprobs),
                                   torch.tensor(out.output_logprobs), atol=2e-2, rtol=0)
