"""LogprobCheck's verdicts on fixed responses (a stub standing in for the remote client's
`generate_on_each`: the verdict logic needs no server; test_remote_engine.py and the vLLM
integration suite run the check against real servers)."""

import asyncio

import pytest
import torch

from asyncrl.api import ModelResponse, StopReason
from asyncrl.launch.weight_check import LogprobCheck, WeightCheckError

LOGPROBS = torch.log_softmax(torch.linspace(-2, 2, 16), -1)


def score(prompt, output, images=None):
    return [LOGPROBS[t].item() for t in output]


class Servers:
    def __init__(self, *replies):
        self.replies = replies

    async def generate_on_each(self, req):
        return [(f"http://s{i}", ModelResponse(input_tokens=list(req.input_ids),
                                               output_tokens=tokens, output_logprobs=values,
                                               output_versions=[0] * len(tokens),
                                               stop_reason=StopReason.LENGTH))
                for i, (tokens, values) in enumerate(self.replies)]


def run(servers, tolerance=0.05):
    return asyncio.run(LogprobCheck(score, [[1, 2]], 1.0, tolerance).run(servers, 4))


def test_agreeing_servers_pass_and_report_the_worst():
    exact = ([3, 5], [LOGPROBS[3].item(), LOGPROBS[5].item()])
    close = ([7], [LOGPROBS[7].item() + 0.01])
    metrics = run(Servers(exact, close))
    assert metrics["weight_check/max_abs_diff"] == pytest.approx(0.01, abs=1e-6)
    assert metrics["weight_check/tokens"] == 3


def test_a_server_off_by_more_than_the_tolerance_is_named():
    off = ([3, 5], [LOGPROBS[3].item() + 0.5, LOGPROBS[5].item()])
    with pytest.raises(WeightCheckError, match=r"http://s1 at weight version 4.*0\.25"):
        run(Servers(([3], [LOGPROBS[3].item()]), off))


def test_tokens_outside_the_trainers_vocab_mean_another_model():
    with pytest.raises(WeightCheckError, match="serves another model"):
        run(Servers(([300], [-1.0]),))


def test_no_server_to_probe_is_an_error_not_a_pass():
    with pytest.raises(WeightCheckError, match="no healthy server"):
        run(Servers())
