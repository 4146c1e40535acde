"""FSDP2 on 2 gloo processes; one torchrun launch (the `worker` fixture) serves every test here.

- One step on 2 ranks equals one step on one process (weights, stats, trained logprobs).
- Sharded (DCP) checkpoints resume on another world size. Saved on 2 ranks after 2 steps, then
  resumed on 2 ranks (fresh engines in the worker) and on 1 process (here): the weights and the
  full Adam state equal those at save time, each rank's RNG state comes back, and the next step
  gives the loss and weights of the 2-rank run that went on without a restart. Saved on 1
  process, resumed on 2 ranks: the same, rank 1 re-seeded deterministically (and logged).
- bf16 (`autocast_dtype`): fully_shard's mixed precision computes with bf16 weights while the
  shards, gradients and Adam state stay fp32; the loss is within bf16 tolerance of the
  single-process bf16 autocast run.
- Activation checkpointing: the layers recompute in the backward (twice the forward calls) and
  the loss and gradients equal those without it.

The worker (`__main__` below) runs each rank's part and rank 0 saves the results; the tests
repeat the single-process side here and compare.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
)

from asyncrl.api.trajectory import Sample
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig
from asyncrl.train.checkpoint import load_state, save_state
from asyncrl.train.config import OptimizerConfig, TrainEngineConfig
from asyncrl.train.engine import HFTrainEngine, sft_token_loss
from asyncrl.train.engine import derived_seed, rng_state
from asyncrl.train.packing import pack_samples, shared_prefix_layout

TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                       intermediate_size=128)
# Small Adam lr and a larger eps keep weight comparisons meaningful: see test_train_engine.py.
CFG = TrainEngineConfig(max_tokens_per_mb=16, device="cpu",
                        optimizer=OptimizerConfig(lr=1e-3, eps=1e-6, grad_clip=1.0))
TOTAL_STEPS = 10  # the LR schedule's horizon
BF16 = CFG.model_copy(update={"autocast_dtype": "bfloat16"})
CHECKPOINTING = CFG.model_copy(update={"gradient_checkpointing": True})
# Uneven lengths: on their own the two ranks would pack 2 and 3 micro-batches; they must agree
# on 3 or the FSDP collectives inside forward/backward would deadlock.
LENGTHS = [11, 15, 11, 3, 8, 3, 7]  # rank 0: 2 micro-batches, rank 1: 3
STEPS = 2
# bf16 vs bf16: both paths round the same matmul inputs to bf16, but under FSDP the residual
# stream is bf16 too (bf16 embedding weights), under autocast fp32. Measured: loss 5e-5
# relative, trained logprobs 4e-3 absolute; the bounds leave 20x and 5x room.
BF16_LOSS_RTOL = 1e-3
BF16_LOGPROB_ATOL = 2e-2


def make_samples() -> list[Sample]:
    """Samples 0 and 2 share a prompt: the single process computes it once (share_prefixes),
    FSDP ranks compute it per sample; gradients and trained logprobs must agree."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, 60, (n,), generator=g).tolist()
        p = max(1, n // 3)
        if len(out) == 2:
            ids[:p] = out[0].input_ids[:p]
        out.append(Sample.from_prompt_and_completion(ids[:p], ids[p:], [-1.0] * (n - p),
                                                     [0] * (n - p)))
    return out


class Extra:
    """A plain part saved beside the engine, as a run's data position."""

    def __init__(self, state=None) -> None:
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state) -> None:
        self.state = state


def single_engine(model_dir, cfg=CFG) -> HFTrainEngine:
    return HFTrainEngine(load_causal_lm(model_dir), cfg, total_steps=TOTAL_STEPS)


def fsdp_engine(model_dir, cfg=CFG) -> HFTrainEngine:
    from asyncrl.train.fsdp import FSDP2

    return HFTrainEngine(load_causal_lm(model_dir), cfg, total_steps=TOTAL_STEPS,
                         parallel=FSDP2("cpu"))


def step(engine: HFTrainEngine) -> dict[str, float]:
    return engine.train_batch(make_samples(), sft_token_loss)


def run_steps(engine: HFTrainEngine) -> tuple[list[dict[str, float]], list[torch.Tensor]]:
    stats = [step(engine) for _ in range(STEPS)]
    return stats, engine.forward(make_samples())


def full_optimizer_state(engine: HFTrainEngine) -> dict[str, Any]:
    """Adam state keyed by parameter name, unsharded (rank 0 under FSDP; collective)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(engine.model, engine.optimizer, options=opts)
    return copy.deepcopy(state)  # some of its tensors are the optimizer's own


# --- the worker: one function per scenario, every rank runs each ---------------------------------
def _traced_step(engine) -> tuple[dict[str, float], dict[str, torch.Tensor], int]:
    """One step; its stats, the full gradients (collective) and layer 0's MLP calls."""
    from asyncrl.train.fsdp import decoder_layers

    calls = []
    mlp = decoder_layers(engine.model)[0].mlp
    # a pre-hook: the recomputation stops early, once the inputs the backward needs are back
    hook = mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    stats = step(engine)
    hook.remove()
    grads = {n: p.grad.full_tensor() for n, p in engine.model.named_parameters()}
    return stats, grads, len(calls)


def _equal_to_one_process(engine) -> dict[str, Any]:
    first, grads, calls = _traced_step(engine)
    stats = [first, *(step(engine) for _ in range(STEPS - 1))]
    return {"stats": stats, "logprobs": engine.forward(make_samples()), "grads": grads,
            "mlp_calls": calls, "state": engine.model_state_dict(), "step": engine.step}


def _sharded_resume(engine, model_dir: str, work: Path) -> dict[str, Any]:
    """Save after STEPS steps, go on one step; a fresh 2-rank engine resumes and steps."""
    ckpt = work / "ckpt_2ranks"
    torch.manual_seed(100 + engine.parallel.rank)  # distinct per-rank RNG states, each must come back
    rng_at_save = torch.get_rng_state()
    at_save = {"optim": full_optimizer_state(engine), "weights": engine.model_state_dict()}
    engine.version.set(5)
    save_state(ckpt, engine.parallel, {"trainer": engine}, {"data": Extra({"data_position": 7})})
    went_on = {"stats": step(engine), "weights": engine.model_state_dict()}

    torch.manual_seed(999)
    resumed = fsdp_engine(model_dir)
    extra = Extra()
    load_state(ckpt, resumed.parallel, {"trainer": resumed},
               {"data": extra} if resumed.parallel.rank == 0 else None)
    rng_back = torch.equal(torch.get_rng_state(), rng_at_save)
    loaded = {"optim": full_optimizer_state(resumed), "weights": resumed.model_state_dict(),
              "step": resumed.step, "version": resumed.version.value, "extra": extra.state}
    after = {"stats": step(resumed), "weights": resumed.model_state_dict()}
    return {"ckpt": ckpt, "rng_at_save": rng_at_save, "rng_back": _all_ranks(rng_back),
            "at_save": at_save, "went_on": went_on, "loaded": loaded, "resumed": after}


def _resume_from_one_process(model_dir: str, ckpt: Path, saved_rng: dict) -> dict[str, Any]:
    engine = fsdp_engine(model_dir)
    load_state(ckpt, engine.parallel, {"trainer": engine})
    got = torch.get_rng_state()
    if engine.parallel.rank == 0:
        expected = saved_rng["torch"]
    else:
        torch.manual_seed(derived_seed(saved_rng, engine.parallel.rank))
        expected = torch.get_rng_state()
    rng_ok = _all_ranks(torch.equal(got, expected))
    return {"weights": engine.model_state_dict(), "optim": full_optimizer_state(engine),
            "rng_ok": rng_ok, "stats": step(engine), "after": engine.model_state_dict()}


def _bf16(model_dir: str) -> dict[str, Any]:
    from asyncrl.train.fsdp import decoder_layers

    engine = fsdp_engine(model_dir, BF16)
    compute = set()
    proj = decoder_layers(engine.model)[0].mlp.down_proj
    hook = proj.register_forward_pre_hook(lambda m, _: compute.add(m.weight.dtype))
    stats = [step(engine) for _ in range(STEPS)]
    hook.remove()
    # (read before `forward`, after which FSDP2 leaves the root's gathered bf16 weights in place)
    dtypes = {"shards": {p.dtype for p in engine.model.parameters()},
              "grads": {p.grad.dtype for p in engine.model.parameters()},
              "adam": {t.dtype for s in engine.optimizer.state.values() for t in s.values()}}
    return {"stats": stats, "logprobs": engine.forward(make_samples()), "compute": compute,
            **dtypes}


def _activation_checkpointing(model_dir: str) -> dict[str, Any]:
    engine = fsdp_engine(model_dir, CHECKPOINTING)
    stats, grads, calls = _traced_step(engine)
    return {"stats": stats, "grads": grads, "mlp_calls": calls}


def _all_ranks(flag: bool) -> list[bool]:
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, flag)
    return gathered


def _worker(model_dir: str, work: str) -> None:
    torch.set_num_threads(1)
    work_dir = Path(work)
    engine = fsdp_engine(model_dir)
    saved_rng = torch.load(work_dir / "rng_1proc.pt", weights_only=False)
    out = {"equal": _equal_to_one_process(engine),
           "resume": _sharded_resume(engine, model_dir, work_dir),
           "from_one": _resume_from_one_process(model_dir, work_dir / "ckpt_1proc", saved_rng),
           "bf16": _bf16(model_dir),
           "checkpointing": _activation_checkpointing(model_dir)}
    if engine.parallel.rank == 0:
        torch.save(out, work_dir / "fsdp.pt")
    torch.distributed.destroy_process_group()


# --- the tests -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OneThread:
    """The ranks run single-threaded; so does the single-process side, for equal float sums."""

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("fsdp")
    model_dir = build_tiny_model(TINY, work / "tiny")
    with OneThread():  # the 1-process checkpoint the ranks resume from, and its next step
        torch.manual_seed(5)
        single = single_engine(model_dir)
        step(single)
        torch.save(rng_state(), work / "rng_1proc.pt")
        save_state(work / "ckpt_1proc", single.parallel, {"trainer": single})
        went_on = {"stats": step(single), "weights": single.model.state_dict()}
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), __file__, str(model_dir), str(work)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"torchrun 2 ranks: {time.perf_counter() - t0:.1f}s")
    out = torch.load(work / "fsdp.pt", weights_only=False)
    return {**out, "model_dir": model_dir, "work": work, "stderr": proc.stderr,
            "one_went_on": went_on}


def assert_states_equal(a: dict[str, Any], b: dict[str, Any], atol: float = 0.0) -> None:
    assert set(a) == set(b)
    for name in a:
        if isinstance(a[name], dict):
            assert_states_equal(a[name], b[name], atol)
        elif isinstance(a[name], torch.Tensor):
            torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)
        else:
            assert a[name] == b[name], name


def test_fsdp_two_ranks_equal_one_process(worker):
    dist_run = worker["equal"]
    with OneThread():
        single = single_engine(worker["model_dir"])
        stats, logprobs = run_steps(single)
    assert dist_run["step"] == single.step == STEPS
    for d, s in zip(dist_run["stats"], stats):
        assert abs(d["train/loss"] - s["train/loss"]) < 1e-5
        assert d["train/loss_tokens"] == s["train/loss_tokens"]
        assert abs(d["train/grad_norm"] - s["train/grad_norm"]) < 1e-5
        assert abs(d["sft/nll_per_token"] - s["sft/nll_per_token"]) < 1e-5
    assert_states_equal(dist_run["state"], single.model.state_dict(), atol=1e-5)
    assert single.share_prefixes and shared_prefix_layout(
        pack_samples(make_samples()[:3], range(3))) is not None
    for sample, a, b in zip(make_samples(), dist_run["logprobs"], logprobs):
        trained = torch.tensor(sample.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(a[trained], b[trained], atol=1e-5, rtol=0)


def test_sharded_checkpoint_resumes_on_two_ranks_and_on_one(worker, caplog):
    res = worker["resume"]
    assert res["rng_back"] == [True, True]  # each rank's own RNG state
    loaded = res["loaded"]
    assert (loaded["step"], loaded["version"], loaded["extra"]) == (
        STEPS, 5, {"data_position": 7})
    assert_states_equal(loaded["weights"], res["at_save"]["weights"])  # bit-exact
    assert_states_equal(loaded["optim"], res["at_save"]["optim"])
    went_on = res["went_on"]
    assert res["resumed"]["stats"]["train/loss"] == went_on["stats"]["train/loss"]
    assert_states_equal(res["resumed"]["weights"], went_on["weights"])

    with OneThread(), caplog.at_level(logging.WARNING, logger="asyncrl.train.engine"):
        torch.manual_seed(999)
        single = single_engine(worker["model_dir"])
        extra = Extra()
        load_state(res["ckpt"], single.parallel, {"trainer": single}, {"data": extra})
        counters = (single.step, single.version.value, extra.state)
        rng = torch.get_rng_state()
        optim = full_optimizer_state(single)
        weights = {k: v.clone() for k, v in single.model.state_dict().items()}
        stats = step(single)
    assert "holds RNG states of 2 ranks, this run has 1" in caplog.text
    assert torch.equal(rng, res["rng_at_save"])  # rank 0's
    assert counters == (STEPS, 5, {"data_position": 7})
    assert_states_equal(weights, res["at_save"]["weights"])
    assert_states_equal(optim, res["at_save"]["optim"])
    # one process vs 2 ranks: the same step up to float summation order
    assert abs(stats["train/loss"] - went_on["stats"]["train/loss"]) < 1e-5
    assert_states_equal(single.model.state_dict(), went_on["weights"], atol=1e-5)


def test_one_process_checkpoint_resumes_on_two_ranks(worker):
    res, went_on = worker["from_one"], worker["one_went_on"]
    assert res["rng_ok"] == [True, True]  # rank 0 restored, rank 1 derived from it
    assert "ranks 1..1 re-seeded deterministically" in worker["stderr"]
    single = single_engine(worker["model_dir"])
    load_state(worker["work"] / "ckpt_1proc", single.parallel, {"trainer": single})
    assert_states_equal(res["weights"], single.model.state_dict())
    assert_states_equal(res["optim"], full_optimizer_state(single))
    assert abs(res["stats"]["train/loss"] - went_on["stats"]["train/loss"]) < 1e-5
    assert_states_equal(res["after"], went_on["weights"], atol=1e-5)


def test_bf16_mixed_precision_matches_one_process_autocast(worker):
    res = worker["bf16"]
    assert res["compute"] == {torch.bfloat16}  # gathered for compute in bf16
    assert res["shards"] == res["grads"] == res["adam"] == {torch.float32}  # fp32 master state
    with OneThread():
        single = single_engine(worker["model_dir"], BF16)
        stats, logprobs = run_steps(single)
    for d, s in zip(res["stats"], stats):
        assert d["train/loss"] == pytest.approx(s["train/loss"], rel=BF16_LOSS_RTOL)
        assert d["train/loss_tokens"] == s["train/loss_tokens"]
    for sample, a, b in zip(make_samples(), res["logprobs"], logprobs):
        trained = torch.tensor(sample.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(a[trained], b[trained], atol=BF16_LOGPROB_ATOL, rtol=0)


def test_activation_checkpointing_under_fsdp_gives_the_same_step(worker):
    plain, ckpt = worker["equal"], worker["checkpointing"]
    n_mb = int(plain["stats"][0]["train/micro_batches"])
    assert plain["mlp_calls"] == n_mb and ckpt["mlp_calls"] == 2 * n_mb  # recomputed in backward
    assert abs(ckpt["stats"]["train/loss"] - plain["stats"][0]["train/loss"]) < 1e-6
    assert_states_equal(ckpt["grads"], plain["grads"], atol=1e-6)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
    # Skip interpreter teardown: C++ threads of the torch.distributed stack still being destroyed
    # at exit can abort a finished worker ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
