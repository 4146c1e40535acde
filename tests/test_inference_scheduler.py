"""Scheduler and sampler units: slot compaction, admission, prefill budget, logprob convention."""

import math

import pytest
import torch

from asyncrl.api import GenerationConfig, StopReason
from asyncrl.inference.sampler import Sampler
from asyncrl.inference.scheduler import Phase, Scheduler, SeqStatus, Sequence


def seq(rid, n_tokens=4, **gc):
    return Sequence(rid, list(range(n_tokens)), GenerationConfig(**gc))


def assert_compact(s: Scheduler):
    assert [q.slot for q in s.running] == list(range(len(s.running)))


def test_admission_by_free_slots_then_decode():
    s = Scheduler(num_slots=2, max_seq_len=64, max_prefill_tokens=1000)
    a, b, c = seq("a"), seq("b"), seq("c")
    for q in (a, b, c):
        s.add(q)
    batch = s.schedule()
    assert batch.phase == Phase.PREFILL and batch.seqs == [a, b]
    assert c.status == SeqStatus.WAITING and c.slot == -1
    for q in batch.seqs:
        q.num_cached = q.num_tokens  # what the engine does after a prefill
    batch = s.schedule()
    assert batch.phase == Phase.DECODE and batch.seqs == [a, b]
    assert s.release([a], StopReason.STOP) == [(1, 0)]  # b moves into the freed slot 0
    assert b.slot == 0 and a.status == SeqStatus.FINISHED and a.stop_reason == StopReason.STOP
    batch = s.schedule()  # c joins as soon as a slot is free
    assert batch.phase == Phase.PREFILL and batch.seqs == [c] and c.slot == 1
    assert_compact(s)


def test_release_many_moves_each_survivor_at_most_once():
    s = Scheduler(num_slots=6, max_seq_len=64, max_prefill_tokens=1000)
    seqs = [seq(str(i)) for i in range(6)]
    for q in seqs:
        s.add(q)
    s.schedule()
    moves = s.release([seqs[0], seqs[2], seqs[5]], StopReason.LENGTH)
    # survivors 1, 3, 4 -> new count 3; 3 and 4 sit beyond it and fill holes 0 and 2
    assert sorted(moves) == [(3, 0), (4, 2)]
    assert_compact(s)
    assert {q.rid for q in s.running} == {"1", "3", "4"}
    with pytest.raises(ValueError, match="already released"):
        s.release([seqs[0]], StopReason.ABORT)


def test_release_waiting_and_find():
    s = Scheduler(num_slots=1, max_seq_len=64, max_prefill_tokens=1000)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.add(b)
    s.schedule()
    assert s.find("b") == [b] and s.find(None) == [a, b]
    assert s.release(s.find(None), StopReason.ABORT) == []
    assert not s.has_work() and s.schedule() is None


def test_prefill_budget_counts_padding_and_never_starves():
    s = Scheduler(num_slots=8, max_seq_len=200, max_prefill_tokens=100)
    long, short1, short2 = seq("long", 90), seq("s1", 10), seq("s2", 10)
    for q in (long, short1, short2):
        s.add(q)
    assert s.schedule().seqs == [long]  # 2 * 90 padded tokens would exceed 100
    long.num_cached = long.num_tokens
    assert s.schedule().seqs == [short1, short2]


def test_invalidate_cache_recomputes_running():
    s = Scheduler(num_slots=4, max_seq_len=64, max_prefill_tokens=1000)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.add(b)
    for q in s.schedule().seqs:
        q.num_cached = q.num_tokens
    s.invalidate_cache()
    batch = s.schedule()
    assert batch.phase == Phase.PREFILL and batch.seqs == [a, b] and a.slot == 0


def test_bad_scheduler_config_and_too_long_sequence():
    with pytest.raises(ValueError, match="num_slots=0"):
        Scheduler(num_slots=0, max_seq_len=64, max_prefill_tokens=1)
    s = Scheduler(num_slots=1, max_seq_len=8, max_prefill_tokens=100)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        s.add(seq("x", 8))


def run_sampler(logits, gcs, eos=(), outputs=0, seed=0):
    seqs = [Sequence(str(i), [0], g) for i, g in enumerate(gcs)]
    for s in seqs:
        s.token_ids += [1] * outputs
    return Sampler(list(eos), seed=seed)(logits, seqs), seqs


def test_logprobs_use_temperature_and_ignore_truncation():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    gcs = [
        GenerationConfig(temperature=0.7),
        GenerationConfig(temperature=0.7, top_k=3, top_p=0.5),
        GenerationConfig(greedy=True, temperature=0.5),  # greedy reports temperature-1 logprobs
        GenerationConfig(temperature=1.3, top_k=1),
    ]
    out, _ = run_sampler(logits, gcs)
    temps = torch.tensor([0.7, 0.7, 1.0, 1.3])[:, None]
    ref = torch.log_softmax(logits / temps, -1)
    for i, (tok, lp) in enumerate(zip(out.tokens, out.logprobs)):
        assert lp == pytest.approx(ref[i, tok].item(), abs=1e-6)
    assert out.tokens[2] == logits[2].argmax().item()
    assert out.tokens[3] == logits[3].argmax().item()  # top-k 1 is greedy
    top3 = logits[1].topk(3).indices.tolist()
    assert out.tokens[1] in top3


def test_race_sampling_matches_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    out, _ = run_sampler(logits, [GenerationConfig(temperature=1.0)] * 20000)
    freq = torch.bincount(torch.tensor(out.tokens), minlength=4).float() / 20000
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.015)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().repeat(4000, 1)
    out, _ = run_sampler(logits, [GenerationConfig(top_p=0.75)] * 4000)
    assert set(out.tokens) == {0, 1}  # 0.5 < 0.75 so token 1 is needed; 0.8 >= 0.75 stops


def test_min_new_tokens_suppresses_stop_ids_but_not_their_logprob():
    logits = torch.tensor([[0.0, 10.0, -5.0]])  # token 1 dominates and is the EOS
    out, _ = run_sampler(logits, [GenerationConfig(greedy=True, min_new_tokens=2)], eos=[1])
    assert out.tokens == [0]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item())
    gc = GenerationConfig(greedy=True, min_new_tokens=2)
    out, _ = run_sampler(logits, [gc], eos=[1], outputs=2)
    assert out.tokens == [1]


def test_per_request_seed_is_independent_of_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, 64)
    gc = GenerationConfig(seed=123)
    a, _ = run_sampler(logits[:1], [gc], seed=5)
    b, _ = run_sampler(logits, [gc, GenerationConfig(), GenerationConfig()], seed=9)
    assert a.tokens[0] == b.tokens[0]
    assert not any(math.isnan(x) for x in b.logprobs)
