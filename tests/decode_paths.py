"""Shared by the decode-path tests (tests/test_static_decode.py, tests/test_overlap_steps.py):
tiny random instances of the native architectures and one request schedule to drive an engine
through (mixed prompt lengths, sequences stopping at their own lengths or on stop tokens, a
weight update mid-generation).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from arch_configs import build_instances

from asyncrl.api import GenerationConfig, ModelRequest
from asyncrl.inference.engine import LLMEngine

ARCHS = ["qwen3", "gemma3", "mistral", "llama3"]
if int(transformers.__version__.split(".")[0]) < 5:
    ARCHS.remove("gemma3")  # its per-layer-type RoPE needs transformers >= 5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{name: (model dir, transformers model)}."""
    return build_instances(ARCHS, tmp_path_factory)


def drive(eng: LLMEngine, model, stop_tokens: bool = False) -> dict:
    """5 sequences (a batch of 8 rows), mixed prompt lengths past the 8-position windows, each
    stopping at its own length (`stop_tokens`: two of them also on any of 35 ids, one of those
    not before 3 tokens); a weight update after request 0's 8th token. Outputs by request id."""
    g = torch.Generator().manual_seed(1)
    for i, (length, new) in enumerate([(3, 20), (11, 6), (25, 14), (6, 9), (17, 30)]):
        prompt = torch.randint(5, 101, (length,), generator=g).tolist()
        stops = dict(stop_token_ids=list(range(5, 40)), min_new_tokens=3 * (i == 3)) if (
            stop_tokens and i in (1, 3)) else {}
        eng.add_request(ModelRequest(prompt, GenerationConfig(max_new_tokens=new, seed=i,
                                                              **stops), rid=str(i)))
    done = []
    while drawn(eng, "0") < 8:  # the update lands after request 0's 8th token
        done += eng.step()
    g = torch.Generator().manual_seed(7)
    eng.update_weights_from_state_dict(
        {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()},
        version=1)
    while eng.has_unfinished():
        done += eng.step()
    return {o.rid: o for o in done}


def drawn(eng: LLMEngine, rid: str) -> int:
    """Tokens request `rid` has drawn, counting an overlapped step's that it does not hold yet."""
    seq = eng.get_sequence(rid)
    launched = eng._launched
    return seq.num_outputs + (launched is not None and any(q is seq for q in launched.seqs))
