"""Rollout routing replay (R3) on mixture-of-experts models: the built-in engine records the experts
each sparse layer chose for every token it read, and returns them with the response."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from arch_configs import CONFIGS, build_instances, three_step_job

from asyncrl.api import GenerationConfig, ModelRequest
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.models.routes import UNROUTED
from asyncrl.models.tokenizer import build_byte_tokenizer, save_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTHS = [3, 11, 25, 6]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_instances(["qwen3-moe", "mixtral", "qwen3"], tmp_path_factory)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, 101, (n,), generator=g).tolist() for n in LENGTHS]


def engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=str(path), max_seq_len=64, device="cpu",
                                  max_num_seqs=8, backend="native", record_routes=True, **kw))


def hf_routes(model, ids: list[int]) -> np.ndarray:
    """The experts transformers' own forward routes each token to: [tokens, sparse layers, k]."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    picks = [logits.float().softmax(-1).topk(k, -1).indices for logits in out.router_logits]
    return torch.stack(picks, 1).numpy()


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_the_engine_records_the_experts_transformers_routes_to(name, cpu_kernels, built, prompts):
    path, model = built[name]
    outs = engine(path, cpu_kernels=cpu_kernels).generate(
        [ModelRequest(p, GenerationConfig(max_new_tokens=9, seed=i)) for i, p in enumerate(prompts)])
    sparse = 2 if name == "qwen3-moe" else 3  # Qwen3-MoE's middle layer is dense
    for p, out in zip(prompts, outs):
        ids = p + out.output_tokens
        assert out.routes.shape == (len(ids), sparse, 2) and out.routes.dtype == np.int16
        assert (out.routes[-1] == UNROUTED).all()  # the last token was never read
        # every token read: the prompt's in the prefill, each generated one in the next decode
        ref = hf_routes(model, ids)[:-1]
        assert np.array_equal(np.sort(out.routes[:-1], -1), np.sort(ref, -1))


def test_routes_span_a_weight_update_and_are_recomputed_with_the_cache(built, prompts):
    """A weight update mid-generation: the cache is recomputed under the new weights, and so are
    the routes of every token so far (the routing the later tokens were drawn under)."""
    path, model = built["qwen3-moe"]
    eng = engine(path)
    for p in prompts:
        eng.add_request(ModelRequest(p, GenerationConfig(max_new_tokens=12, seed=3)))
    for _ in range(5):
        eng.step()
    g = torch.Generator().manual_seed(7)
    new_sd = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    eng.update_weights_from_state_dict(new_sd, version=1)
    done = []
    while eng.has_unfinished():
        done += eng.step()
    new = transformers.AutoModelForCausalLM.from_config(CONFIGS["qwen3-moe"]).eval()
    new.load_state_dict(new_sd)
    for out in done:
        ids = out.input_tokens + out.output_tokens
        ref = hf_routes(new, ids)[:-1]
        assert np.array_equal(np.sort(out.routes[:-1], -1), np.sort(ref, -1))


def test_a_dense_model_is_refused_and_routes_are_off_by_default(built, prompts):
    with pytest.raises(ValueError, match="record_routes=True needs a mixture-of-experts model"):
        engine(built["qwen3"][0])
    path, _ = built["mixtral"]
    plain = LLMEngine(EngineConfig(model_path=str(path), max_seq_len=64, device="cpu"))
    out = plain.generate([ModelRequest(prompts[0], GenerationConfig(max_new_tokens=3))])[0]
    assert out.routes is None


# ---- the trainer replays them ---------------------------------------------------------------

def near_tied(model) -> dict[str, torch.Tensor]:
    """`model`'s weights with each router's experts a hair apart (rows equal up to 1e-6 of
    their scale): routings are decided at the level of rounding, which the engine's and the
    trainer's arithmetic do differently."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(2)
    for name, w in sd.items():
        if name.endswith("mlp.gate.weight"):
            w[:] = w[0] + 1e-6 * w[0].abs().mean() * torch.randn(w.shape, generator=g)
    return sd


def samples_of(outs):
    from asyncrl.api.trajectory import Sample

    return [Sample.from_prompt_and_completion(o.input_tokens, o.output_tokens, o.output_logprobs,
                                              o.output_versions, routes=o.routes) for o in outs]


def trainer(model, layout: str, mode):
    from asyncrl.train.config import TrainEngineConfig
    from asyncrl.train.engine import HFTrainEngine

    return HFTrainEngine(model, TrainEngineConfig(device="cpu", attention_layout=layout),
                         trainable=False, routing=mode)


def gap(engine_out, samples) -> float:
    worst = 0.0
    for s, lp in zip(samples, engine_out):
        m = torch.tensor(s.loss_mask, dtype=torch.bool)
        worst = max(worst, float((lp[m] - torch.tensor(s.logprobs)[m]).abs().max()))
    return worst


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_replay_removes_the_gap_that_route_flips_open(layout, built, prompts, tmp_path):
    """Routers at a near-tie: without replay the trainer routes some tokens to other experts
    than the engine did and scores the sampled tokens differently; with the engine's routes
    replayed, its logprobs equal the engine's within 1e-5."""
    from asyncrl.train.route_replay import Mode

    weights = near_tied(built["qwen3-moe"][1])

    def model():  # one per trainer (each hooks its routers)
        m = transformers.AutoModelForCausalLM.from_config(CONFIGS["qwen3-moe"]).eval()
        m.load_state_dict(weights)
        return m

    model().save_pretrained(tmp_path)
    save_tokenizer(build_byte_tokenizer(), tmp_path)
    outs = engine(tmp_path).generate(
        [ModelRequest(p, GenerationConfig(max_new_tokens=12, seed=i)) for i, p in enumerate(prompts)])
    samples = samples_of(outs)
    observed = trainer(model(), layout, Mode.OBSERVE)
    free = observed.forward(samples)
    flips = observed.routing.take_metrics()["moe/route_flip_frac"]
    assert flips > 0.05 and gap(free, samples) > 1e-2
    observed.version.set(1)  # the same samples, now one version old: their flips count as stale
    observed.forward(samples)
    assert observed.routing.take_metrics() == {"moe/route_flip_frac_stale": flips}
    replayed = trainer(model(), layout, Mode.REPLAY).forward(samples)
    assert gap(replayed, samples) < 1e-5


def test_replay_keeps_the_router_trainable(built, prompts):
    """Replaying the routes the trainer would pick anyway gives its own forward exactly, and the
    router's gradient too (the weights of the replayed experts come from the live router)."""
    from asyncrl.train.packing import pack_samples
    from asyncrl.train.route_replay import Mode

    path, model = built["mixtral"]
    outs = engine(path).generate(
        [ModelRequest(p, GenerationConfig(max_new_tokens=6, seed=i)) for i, p in enumerate(prompts)])
    samples = samples_of(outs)

    def grads(mode):
        eng = trainer(transformers.AutoModelForCausalLM.from_config(CONFIGS["mixtral"]),
                      "packed", mode)
        eng.model.load_state_dict(model.state_dict())
        eng.model.requires_grad_(True)
        mb = pack_samples(samples, list(range(len(samples))))
        logprobs = eng.per_token(mb)
        logprobs[mb.loss_mask].sum().backward()
        return logprobs.detach(), {n: p.grad.clone() for n, p in eng.model.named_parameters()
                                   if n.endswith("mlp.gate.weight")}

    live_lp, live = grads(None)
    replay_lp, replay = grads(Mode.REPLAY)
    assert torch.allclose(live_lp, replay_lp, atol=1e-6)
    assert len(replay) == 3 and all(g.abs().sum() > 0 for g in replay.values())
    for name in live:
        assert torch.allclose(live[name], replay[name], atol=1e-5), name


def test_routes_survive_packing_next_to_samples_without():
    from asyncrl.api.trajectory import Sample
    from asyncrl.train.packing import pack_samples

    routed = Sample([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, 0, 0],
                    routes=np.arange(18, dtype=np.int16).reshape(3, 3, 2))
    plain = Sample([4, 5], [0, 1], [0.0, -1.0], [-1, 0])
    mb = pack_samples([plain, routed], [1, 0])
    assert mb.tensors["routes"].shape == (5, 3, 2)
    assert mb.tensors["routes"][:3].flatten().tolist() == list(range(18))
    assert (mb.tensors["routes"][3:] == UNROUTED).all()


# ---- a job -----------------------------------------------------------------------------------

def test_a_tiny_moe_job_trains_with_routing_replay(built, tmp_path):
    """3 steps of `asyncrl train` on a tiny random Qwen3-MoE with actor.moe.routing_replay: the
    in-process engine records routes, the trainer replays them, and each step reports the gap
    without replay and the route-flip share."""
    import json

    from asyncrl import Trainer
    from asyncrl.launch.train_config import TrainRunConfig

    path, _ = built["qwen3-moe"]
    cfg = TrainRunConfig.load(None, [
        *three_step_job(path, tmp_path / "run"), "actor.moe.routing_replay=true",
        "rollout.max_head_offpolicyness=0"])  # every token fresh: the gaps are measured
    assert Trainer(cfg).train().steps == 3
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()
             if '"moe/' in line]
    assert len(steps) == 3
    for m in steps:
        assert m["moe/unreplayed_tokens"] == 0  # every token the trainer read was recorded
        assert 0.0 <= m["moe/route_flip_frac"] <= 1.0
        assert m["moe/logprob_diff_unreplayed_max"] < 1e-3  # random weights: no near-ties
        assert m["mismatch/logprob_diff_max"] < 1e-4


def test_routing_replay_is_refused_for_a_dense_model(built):
    from asyncrl.launch.train_config import TrainRunConfig

    with pytest.raises(ValueError, match="routing_replay=true needs a mixture-of-experts model"):
        TrainRunConfig.load(None, ["actor.moe.routing_replay=true"])
    with pytest.raises(ValueError, match="is dense"):
        TrainRunConfig.load(None, [f"model.path={built['qwen3'][0]}",
                                   "actor.moe.routing_replay=true"])
    TrainRunConfig.load(None, ["actor.moe.routing_replay=true", "warm_start.tiny.arch=qwen3_moe"])


class OneAnswer:
    """One generation per episode, its routes kept (what the rlvr workflow does)."""

    def __init__(self):
        import threading

        self.started = threading.Event()

    async def arun_episode(self, engine, data):
        from asyncrl.api import Trajectory
        from asyncrl.api.trajectory import Sample

        self.started.set()
        prompt = [5 + data["id"] % 60, 7, 9, 11]
        g = GenerationConfig(max_new_tokens=40, min_new_tokens=40)
        r = await engine.agenerate(ModelRequest(prompt, g))
        return Trajectory([Sample.from_prompt_and_completion(
            prompt, r.output_tokens, r.output_logprobs, r.output_versions, routes=r.routes)],
            group_id=str(data["id"]))


def test_routes_survive_a_resume_with_episodes_in_flight(built, tmp_path):
    """Episodes suspended mid-generation, pickled as a checkpoint keeps them, continued by a new
    engine: each sample's routes still cover every token it read, as transformers routes them."""
    import pickle

    from asyncrl.inference.async_engine import AsyncLLMEngine
    from asyncrl.rollout.executor import RolloutConfig, WorkflowExecutor

    path, model = built["qwen3-moe"]
    cfg = RolloutConfig(batch_size=4, max_concurrent_rollouts=16, max_head_offpolicyness=15)
    workflow = OneAnswer()

    def async_engine():
        return AsyncLLMEngine(LLMEngine(EngineConfig(
            model_path=str(path), max_seq_len=64, device="cpu", max_num_seqs=4,
            backend="native", record_routes=True)))

    eng = async_engine()
    with WorkflowExecutor(eng, cfg, workflow) as ex:
        for i in range(16):
            ex.submit({"id": i})
        assert workflow.started.wait(60)
        snap = ex.suspend(eng.interrupt, timeout=30)
        saved = pickle.loads(pickle.dumps(ex.state_dict()))
    eng.shutdown()
    assert snap.counts()["partial_calls"] > 0
    eng = async_engine()
    with WorkflowExecutor(eng, cfg, workflow) as ex:
        ex.load_state_dict(saved)
        trajs = ex.wait(16, timeout=120)
        continued = ex.stats()["continued_calls"]
    eng.shutdown()
    assert continued > 0 and len(trajs) == 16
    for t in trajs:
        s = t.samples[0]
        assert s.routes.shape[0] == len(s.input_ids)
        ref = hf_routes(model, s.input_ids)[:-1]
        assert np.array_equal(np.sort(s.routes[:-1], -1), np.sort(ref, -1))
