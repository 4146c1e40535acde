"""LoRA (`train.lora`) with asynchronous weight sync, on real parts: PEFT on the trainer, the
built-in engine in process and in `asyncrl serve` subprocesses, the real Trainer loop.

- The engine's merge (models/lora.py) computes what PEFT computes: its logprobs after an adapter
  update, from memory or from a directory `PeftModel.save_pretrained` wrote, equal transformers +
  peft's on the same tokens; successive adapters do not accumulate.
- The train engine trains the adapter only (only A and B are in the optimizer; the base stays).
- The main job (tiny model, arithmetic prompts) in process, through a real `asyncrl serve`
  (HTTP buckets and adapter directories) and across a resume: after every push the logprob
  canary (every=1, tolerance 1e-4) finds the engines computing the trainer's logprobs, only the
  adapter's tensors travel, the checkpoint holds the adapter in PEFT format plus the merged
  policy, and the base weights are unchanged. Without the adapter reaching the engine the same
  canary stops the run (the control that shows the check can fail).
- The same under torchrun (FSDP2, 2 gloo ranks) with the critic (estimator gae).
- The config refuses what LoRA cannot do (broadcast sync, SGLang, a LoRA critic, embeddings).
"""

import asyncio
import json
import math
from pathlib import Path

import peft
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from test_train_loop import metrics, small_config, torchrun_train
from train_helpers import digit_reward, sharded_parts
from transformers import AutoModelForCausalLM

from asyncrl import Trainer
from asyncrl.api import GenerationConfig, ModelRequest, WeightUpdateMeta
from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig
from asyncrl.launch.train_config import TrainRunConfig
from asyncrl.launch.weight_check import WeightCheckError
from asyncrl.models.lora import (adapted_weights, merge_adapter, read_adapter_dir,
                                 read_safetensors)
from asyncrl.train.engine import HFTrainEngine, sft_token_loss
from asyncrl.train.lora import adapter_state_dict, apply_lora
from asyncrl.train.config import LoraConfig

pytestmark = pytest.mark.usefixtures("one_thread")
TOLERANCE = 1e-4  # mean |engine - trainer| logprob; fp32 merge vs PEFT's unmerged path: ~1e-7
# fp32 on the CPU, also where CUDA is (there the engine's bf16 is ~1e-3 off: seen on an H200)
LORA = {"train.lora": {"r": 8}, "train.optimizer.lr": 1e-2, "train.optimizer.warmup_steps": 5,
        "train.device": "cpu",
        "inference.engine.device": "cpu",
        "inference.check_logprobs_every": 1, "inference.check_logprobs_tolerance": TOLERANCE}


def peft_model(model_dir, seed, r=4):
    """The tiny model under a PEFT LoRA adapter with random non-zero B (it changes outputs)."""
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=r))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model.eval()


def peft_logprobs(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def generate(engine, prompt):
    req = ModelRequest(prompt, GenerationConfig(max_new_tokens=6, temperature=1.0, top_k=0))
    return asyncio.run(engine.agenerate(req))


def test_engine_applies_adapters_exactly_from_memory_and_from_disk(model_dir, tmp_path):
    first, second = peft_model(model_dir, seed=1), peft_model(model_dir, seed=2)
    second.save_pretrained(tmp_path / "adapter")  # PEFT's own writer: the on-disk format
    prompt = [5, 9, 13, 7]
    with AsyncLLMEngine(EngineConfig(model_path=str(model_dir), max_num_seqs=4,
                                     device="cpu")) as engine:
        base = generate(engine, prompt)
        meta = WeightUpdateMeta.lora_from_tensors(1, scale=16.0 / 4)
        asyncio.run(engine.update_weights(meta, adapter_state_dict(first)))
        resp = generate(engine, prompt)
        assert resp.output_versions == [1] * len(resp.output_tokens)
        ours = peft_logprobs(first, prompt, resp.output_tokens)
        assert max(abs(a - b) for a, b in zip(ours, resp.output_logprobs)) < 1e-5
        # the adapter changes what the engine computes (so the comparison above means something)
        before = peft_logprobs(first, prompt, base.output_tokens)
        assert max(abs(a - b) for a, b in zip(before, base.output_logprobs)) > 1e-2
        # v2 from disk replaces v1 (merged into the base, not on top of v1)
        asyncio.run(engine.update_weights(WeightUpdateMeta.lora_from_disk(
            str(tmp_path / "adapter"), 2)))
        resp = generate(engine, prompt)
        assert resp.output_versions == [2] * len(resp.output_tokens)
        ours = peft_logprobs(second, prompt, resp.output_tokens)
        assert max(abs(a - b) for a, b in zip(ours, resp.output_logprobs)) < 1e-5


def test_merge_equals_peft_merge_and_refuses_other_adapter_parts(model_dir):
    model = peft_model(model_dir, seed=3)
    adapter = adapter_state_dict(model)
    assert len(adapted_weights(adapter)) == 2 * 7  # every linear projection of both layers
    base = load_file(str(Path(model_dir) / "model.safetensors"))
    merged = merge_adapter(base, adapter, 16.0 / 4)
    expected = model.merge_and_unload().state_dict()
    assert max(float((merged[k] - expected[k]).abs().max()) for k in merged) < 1e-6
    with pytest.raises(ValueError, match="lora_embedding_A"):
        merge_adapter(base, {"base_model.model.model.embed_tokens.lora_embedding_A": base[
            "model.norm.weight"]}, 1.0)


def test_train_engine_trains_the_adapter_only(model_dir):
    from conftest import make_samples

    engine = HFTrainEngine.from_pretrained(model_dir, lora=LoraConfig(r=8))
    trained = [p for g in engine.optimizer.param_groups for p in g["params"]]
    lora = [p for n, p in engine.model.named_parameters() if ".lora_" in n]
    assert {id(p) for p in trained} == {id(p) for p in lora}
    base = {k: v.clone() for k, v in engine.model.state_dict().items() if ".lora_" not in k}
    samples = make_samples([12, 20, 9])
    for s in samples:
        s.loss_mask = [1] * len(s.input_ids)
    engine.train_batch(samples, sft_token_loss)
    after = engine.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())
    assert any(float(v.abs().max()) > 0 for k, v in engine.adapter_state_dict().items()
               if "lora_B" in k)  # B starts at zero; one step moved it


def check_lora_run(model_dir, run, steps):
    """What every LoRA main job must show (see the module docstring)."""
    rows = [m for m in metrics(run) if "reward/mean" in m]
    assert [m["policy/version"] for m in rows] == [float(s) for s in range(1, steps + 1)]
    assert all(m["weight_check/mean_abs_diff"] <= TOLERANCE and m["weight_check/tokens"] > 0
               for m in rows)  # the canary ran after every push and the engines agreed
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    adapter, scale = read_adapter_dir(ckpt / "adapter")
    assert scale == 16.0 / 8
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    base = load_file(str(Path(model_dir) / "model.safetensors"))
    full_bytes = sum(t.numel() * t.element_size() for t in base.values())
    # only the adapter's 28 matrices travelled, a fifth of the tiny model's bytes
    assert all(m["weight_sync/tensors"] == len(adapter) == 28 for m in rows)
    assert all(m["weight_sync/bytes"] == adapter_bytes < full_bytes / 4 for m in rows)
    # policy/ = the unchanged base + the adapter; the adapter/ loads with PEFT onto the base
    policy = read_safetensors(ckpt / "policy", list(base))  # one file or save_pretrained shards
    merged = merge_adapter(base, adapter, scale)
    assert all(torch.equal(policy[k], merged.get(k, base[k])) for k in base)
    tuned = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir),
                                           ckpt / "adapter").eval()
    plain = AutoModelForCausalLM.from_pretrained(ckpt / "policy").eval()
    untrained = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        ours, theirs, start = (m(input_ids=ids).logits.log_softmax(-1)
                               for m in (plain, tuned, untrained))
    assert float((ours - theirs).abs().max()) < 1e-5
    # the policy moved far beyond the canary's tolerance: a base-only engine would fail it (how
    # far depends on which groups finish first, which a busy machine changes: 20x is the bound)
    assert float((ours - start).abs().mean()) > 20 * TOLERANCE
    return ckpt


def test_lora_main_job_in_process_then_resume(model_dir, tmp_path):
    run = tmp_path / "run"
    cfg = small_config(model_dir, run, total_steps=2, checkpoint_every=1, **LORA)
    assert Trainer(cfg).train(reward=digit_reward).steps == 2
    ckpt = check_lora_run(model_dir, run, 2)
    # the trainer's sharded state holds Adam moments for the adapter's matrices only
    keys = dcp.FileSystemReader(ckpt / "state").read_metadata().state_dict_metadata
    moments = {k for k in keys if k.startswith("trainer.optim.state.") and k.endswith("exp_avg")}
    assert len(moments) == 28 and all(".lora_" in k for k in moments)
    # resume: the engine starts from the base and is given the checkpoint's adapter first (the
    # canary at start-up would fail otherwise), then training continues the curve
    cfg = small_config(model_dir, run, total_steps=4, checkpoint_every=1, **LORA)
    assert Trainer(cfg, run_dir=run).train(reward=digit_reward, resume=True).steps == 4
    check_lora_run(model_dir, run, 4)
    records = [json.loads(line) for f in (run / "rollouts").glob("*.jsonl")
               for line in f.read_text().splitlines()]
    assert max(r["tail_version"] for r in records) >= 3  # tokens of the resumed adapters


def test_an_adapter_that_never_reaches_the_engine_fails_the_canary(model_dir, tmp_path,
                                                                    monkeypatch):
    """The broken behaviour users reported (adapters never delivered): the engine keeps the
    base weights while the version advances; the canary must stop the run at the first push."""
    monkeypatch.setattr(AsyncLLMEngine, "_merge_adapter", lambda self, meta, weights: {})
    cfg = small_config(model_dir, tmp_path / "run", total_steps=2, **LORA)
    with pytest.raises(WeightCheckError, match="weight version 1"):
        Trainer(cfg).train(reward=digit_reward)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sync", ["tensors", "disk"])
def test_lora_main_job_through_an_asyncrl_serve_subprocess(model_dir, tmp_path, sync):
    run = tmp_path / "run"
    cfg = small_config(model_dir, run, total_steps=3, **LORA,
                       **{"inference.mode": "local", "inference.weight_sync": sync,
                          "rollout.max_head_offpolicyness": 1})
    assert Trainer(cfg).train(reward=digit_reward).steps == 3
    check_lora_run(model_dir, run, 3)
    if sync == "disk":  # PEFT adapter directories, the last eta + 2 kept
        dirs = sorted(p.name for p in (run / "weights").iterdir())
        assert dirs == ["v1", "v2", "v3"]
        assert sorted(p.name for p in (run / "weights/v3").iterdir()) == [
            "adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_under_fsdp_two_gloo_ranks_with_the_critic(model_dir, tmp_path):
    """FSDP2 shards the PEFT model (A and B with their layers); the adapter is gathered one
    matrix at a time for each push; the critic (estimator gae) trains all its own weights."""
    run = tmp_path / "run"
    out = torchrun_train(model_dir, run, "eval.every=2", "eval.size=8",
                         "actor.advantage.estimator=gae", "train.lora.r=8",
                         "train.optimizer.lr=1e-2", "train.optimizer.warmup_steps=5",
                         "inference.check_logprobs_every=1",
                         f"inference.check_logprobs_tolerance={TOLERANCE}")
    assert out.returncode == 0, out.stderr[-4000:]
    check_lora_run(model_dir, run, 2)
    assert all(math.isfinite(m["critic/loss"]) for m in metrics(run) if "reward/mean" in m)
    assert sharded_parts(run / "checkpoints/step_000002") == {"trainer", "critic"}


@pytest.mark.parametrize("overrides, message", [
    (["train.lora.r=8", "inference.mode=local", "inference.weight_sync=gloo"],
     "weight_sync='gloo' with train.lora"),
    (["train.lora.r=8", "inference.mode=local", "inference.backend=sglang"],
     "backend 'sglang' is not supported"),
    (["critic.lora.r=4"], "unknown key 'critic.lora'"),
    (["train.lora.target_modules=[q_proj,lm_head]"], "target_modules"),
    (["train.lora.r=0"], "train.lora.r"),
])
def test_config_refuses_what_lora_cannot_do(overrides, message):
    with pytest.raises(ValueError, match=message):
        TrainRunConfig.load(None, overrides)


def test_lora_is_off_by_default_and_disabled_by_enabled_false():
    assert TrainRunConfig.load(None, []).train.lora is None
    cfg = TrainRunConfig.load(None, ["train.lora.enabled=false"])
    assert cfg.train.lora is not None and not cfg.train.lora.enabled
    assert math.isclose(TrainRunConfig.load(None, ["train.lora.r=8"]).train.lora.scale, 2.0)
