"""PPOActor (one policy update from trajectories), GroupedWorkflow and DataStream."""

import asyncio

import pytest
import torch
from conftest import TINY

from asyncrl.api import Trajectory
from asyncrl.api.trajectory import Sample
from asyncrl.launch.data_stream import DataStream
from asyncrl.launch.rollout_monitor import RolloutMonitor, batch_metrics
from asyncrl.models.tiny import build_tiny_model
from asyncrl.api import EpisodeRejected
from asyncrl.rollout.group import GroupedWorkflow
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.config import TrainEngineConfig
from asyncrl.train.config import OptimizerConfig
from asyncrl.train.ppo_actor import PPOActor, flatten
from asyncrl.train.config import PPOActorConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory):
    path = build_tiny_model(TINY, tmp_path_factory.mktemp("actor") / "m")

    def make(lr=1e-2, **actor):
        eng = HFTrainEngine.from_pretrained(path, TrainEngineConfig(
            device="cpu", optimizer=OptimizerConfig(lr=lr, warmup_steps=0, schedule="constant")))
        return eng, PPOActor(eng, PPOActorConfig.from_dict(actor))
    return make


def group(engine, prompt, completions, rewards, version=0):
    """Samples with the engine's own logprobs as behaviour logprobs (on-policy)."""
    raw = [Sample.from_prompt_and_completion(prompt, c, [0.0] * len(c), [version] * len(c))
           for c in completions]
    lps = engine.forward(raw)
    return Trajectory([Sample.from_prompt_and_completion(
        prompt, c, lp[len(prompt):].tolist(), [version] * len(c), reward=r)
        for c, lp, r in zip(completions, lps, rewards)], group_id="g")


def seq_logprob(engine, traj):
    return [float((lp * torch.tensor(s.loss_mask)).sum())
            for s, lp in zip(traj.samples, engine.forward(traj.samples))]


@pytest.mark.parametrize("proximal", ["recompute", "loglinear", "behaviour"])
def test_update_raises_the_rewarded_completion(engine_factory, proximal):
    eng, actor = engine_factory(proximal={"proximal_logprobs": proximal})
    traj = group(eng, [5, 6, 7], [[10, 11], [12, 13], [14, 15], [16, 17]], [1.0, 0.0, 0.0, 0.0])
    before = seq_logprob(eng, traj)
    for _ in range(3):
        stats = actor.train_step([group(eng, [5, 6, 7], [[10, 11], [12, 13], [14, 15], [16, 17]],
                                        [1.0, 0.0, 0.0, 0.0], version=eng.version.value)])
    after = seq_logprob(eng, traj)
    assert after[0] > before[0] + 0.1
    assert all(a < b for a, b in zip(after[1:], before[1:]))
    assert eng.version.value == 3 and stats["adv/reward_mean"] == pytest.approx(0.25)


def test_uniform_group_gives_zero_advantage_and_no_change(engine_factory):
    eng, actor = engine_factory()
    traj = group(eng, [5, 6], [[10, 11], [12, 13]], [1.0, 1.0])
    data, _ = actor.token_data(*flatten([traj]))
    assert all(v == 0.0 for adv in data["advantages"] for v in adv)
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    actor.train_step([traj])
    assert all(torch.equal(before[k], v) for k, v in eng.model.state_dict().items())


def test_groups_are_trajectories_and_advantages_are_input_aligned(engine_factory):
    eng, actor = engine_factory(proximal={"proximal_logprobs": "behaviour"})
    a = group(eng, [5], [[10, 11, 12], [13]], [1.0, 0.0])
    b = group(eng, [5, 6], [[14], [15, 16]], [0.0, 0.0])
    samples, groups = flatten([a, b])
    assert groups.tolist() == [0, 0, 1, 1]
    data, _ = actor.token_data(samples, groups)
    # group a: rewards 1, 0 -> +/- 0.7071 (std with Bessel) on generated tokens only
    assert data["advantages"][0].tolist() == pytest.approx([0.0, 0.7071, 0.7071, 0.7071], abs=1e-3)
    assert data["advantages"][1].tolist() == pytest.approx([0.0, -0.7071], abs=1e-3)
    assert data["advantages"][2].tolist() == [0.0, 0.0, 0.0]
    assert all(isinstance(t, torch.Tensor) for v in data.values() for t in v)  # no list trip


def test_kl_needs_a_reference(engine_factory):
    eng, _ = engine_factory()
    with pytest.raises(ValueError, match="needs a reference model"):
        PPOActor(eng, PPOActorConfig.from_dict({"ppo": {"kl_coef": 0.1}}))


def test_kl_loss_with_reference_runs(engine_factory):
    eng, _ = engine_factory()
    ref, _ = engine_factory()
    actor = PPOActor(eng, PPOActorConfig.from_dict({"ppo": {"kl_coef": 0.1}}), ref=ref)
    stats = actor.train_step([group(eng, [5], [[10, 11], [12]], [1.0, 0.0])])
    assert stats["actor/kl_ref"] == pytest.approx(0.0, abs=1e-5)  # identical models at step 0


class _Echo:
    """A workflow whose episodes fail, are rejected, or return one sample."""

    def __init__(self, outcomes):
        self.outcomes = list(outcomes)

    async def arun_episode(self, engine, data):
        outcome = self.outcomes.pop(0)
        if outcome == "fail":
            raise RuntimeError("boom")
        if outcome == "reject":
            return None
        return Trajectory([Sample.from_prompt_and_completion([1], [2], [0.0], [0], reward=outcome)])


def test_grouped_workflow_merges_episodes_and_tolerates_failures():
    traj = asyncio.run(GroupedWorkflow(_Echo([1.0, "fail", 0.0, "reject"]), 4)
                       .arun_episode(None, {"id": 7}))
    assert traj.rewards == [1.0, 0.0] and traj.group_id == "7"
    assert asyncio.run(GroupedWorkflow(_Echo([1.0, "reject"]), 2).arun_episode(None, {})) is None
    with pytest.raises(EpisodeRejected, match="1 of 2 episodes of group None survived.*boom"):
        asyncio.run(GroupedWorkflow(_Echo([1.0, "fail"]), 2).arun_episode(None, {}))
    with pytest.raises(ValueError, match="min_size=3"):
        GroupedWorkflow(_Echo([]), 2, min_size=3)


def test_data_stream_resumes_exactly_and_reshuffles_each_epoch():
    rows = [{"id": i} for i in range(10)]
    full = DataStream(rows, seed=3)
    seq = [next(full)["id"] for _ in range(25)]
    assert sorted(seq[:10]) == list(range(10)) and seq[:10] != seq[10:20]
    resumed = DataStream(rows, seed=3)
    resumed.load_state_dict({"position": 13})  # what a checkpoint restores
    assert [next(resumed)["id"] for _ in range(12)] == seq[13:]
    with pytest.raises(ValueError, match="empty"):
        DataStream([])


def test_monitor_counts_every_episode_and_batch_metrics():
    mon = RolloutMonitor(drop_uniform_groups=True)
    s = lambda r, v: Sample.from_prompt_and_completion([1], [2, 3], [0.0, 0.0], [v, v], reward=r)  # noqa: E731
    mixed = Trajectory([s(1.0, 2), s(0.0, 3)], metadata={"start_version": 2})
    same = Trajectory([s(0.0, 3), s(0.0, 3)], metadata={"start_version": 3})
    assert mon.accept(mixed) and not mon.accept(same)
    taken = mon.take()
    assert taken["rollout/episodes"] == 2 and taken["rollout/kept_frac"] == 0.5
    assert taken["reward/all_mean"] == 0.25
    idle = mon.take()  # nothing finished since: a count of 0, no mean and no share (not 0.0)
    assert idle["rollout/episodes"] == 0
    assert "reward/all_mean" not in idle and "rollout/kept_frac" not in idle
    m = batch_metrics([mixed], version=4)
    assert m["staleness/max"] == 2 and m["staleness/token_lag_max"] == 2
    assert m["reward/mean"] == 0.5 and m["batch/tokens"] == 6


def test_minibatches_step_the_optimizer_per_slice_and_the_version_once(engine_factory):
    from asyncrl.train.ppo_actor import minibatches

    assert minibatches(torch.tensor([0, 0, 1, 1, 2, 2]), 2) == [[0, 1, 2, 3], [4, 5]]
    assert minibatches(torch.tensor([0, 0]), 4) == [[0, 1]]
    eng, actor = engine_factory(lr=5e-2, ppo_n_minibatches=2)
    trajs = [group(eng, [5, 6], [[10 + g, 11], [12, 13 + g]], [1.0, 0.0]) for g in range(4)]
    stats = actor.train_step(trajs)
    assert eng.step == 2 and eng.version.value == 1 and stats["ppo/minibatches"] == 2.0
    # the second slice is trained against the pre-update proximal policy: ratios moved off 1
    assert stats["ppo/approx_kl"] > 0
