"""What `asyncrl view` reads and serves: the run's events and recorded samples, the reading of
live and damaged run directories, and the JSON API over a real uvicorn server on 127.0.0.1 (the
page itself is driven in a real browser by tests/integration/test_view_browser.py)."""

import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from conftest import TINY
from PIL import Image

from asyncrl.api import Trajectory
from asyncrl.api.images import ImageInputs
from asyncrl.api.trajectory import Sample
from asyncrl.errors import UserError
from asyncrl.launch.run_events import EventKind, RunEvents
from asyncrl.launch.step_samples import StepSamples, turns, weight_updates
from asyncrl.launch.watchdog import Watchdog, WatchdogConfig
from asyncrl.models.tiny import build_tiny_model
from asyncrl.train.config import OptimizerConfig, PPOActorConfig, TrainEngineConfig
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.ppo_actor import PPOActor
from asyncrl.view.run_dir import RunDir, RunProblem, find_runs, read_lines
from asyncrl.view.server import create_view_app, view


def jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


# ---- the run side --------------------------------------------------------------------------------
def test_events_name_their_kind_and_package_warnings_become_events(tmp_path):
    with RunEvents(tmp_path) as events, events.capture():
        events.emit(EventKind.START, "started")
        events.step = 3
        logging.getLogger("asyncrl.inference.remote").warning("server %d moved", 1)
        logging.getLogger("asyncrl.launch.watchdog").warning("half way to the deadline")
        logging.getLogger("asyncrl.rollout.executor").warning("something else")
        logging.getLogger("asyncrl.rollout.executor").info("not an event")
        logging.getLogger("other.package").warning("not ours")
    logging.getLogger("asyncrl.inference.remote").warning("after the run: not recorded")
    got = [(e["step"], e["kind"], e["message"]) for e in jsonl(tmp_path / "events.jsonl")]
    assert got == [(0, "start", "started"), (3, "server", "server 1 moved"),
                   (3, "watchdog", "half way to the deadline"), (3, "warning", "something else")]


def test_the_watchdog_warns_once_per_step_at_half_a_limit(caplog):
    dog = Watchdog(WatchdogConfig(max_rejected_in_a_row=10, step_deadline_s=100.0))
    with caplog.at_level(logging.WARNING, "asyncrl.launch.watchdog"):
        dog.check({"rejected_in_a_row": 4}, 10.0, step=2)
        assert not caplog.records
        for _ in range(3):
            dog.check({"rejected_in_a_row": 5}, 50.0, step=2)
        dog.check({"rejected_in_a_row": 6}, 1.0, step=3)
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        "5 episodes in a row rejected or failed after step 2",
        "no training step for 50s after step 2",
        "6 episodes in a row rejected or failed after step 3"]


def test_weight_updates_and_turns_are_read_off_versions_and_the_mask():
    # prompt (3) | model turn v4 v4 v5 | tool (2) | model turn v5 v6
    ids = list(range(10))
    mask = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    vers = [-1, -1, -1, 4, 4, 5, -1, -1, 5, 6]
    rewards = [0.0] * 10
    rewards[5], rewards[9] = 0.5, 1.0
    s = Sample(ids, mask, [0.0] * 10, vers, token_rewards=rewards)
    assert weight_updates(vers, mask) == [5, 9]  # not at 8: a new turn, not an interruption
    assert turns(s) == [{"role": "context", "start": 0, "end": 3},
                        {"role": "model", "start": 3, "end": 6, "reward": 0.5},
                        {"role": "context", "start": 6, "end": 8},
                        {"role": "model", "start": 8, "end": 10, "reward": 1.0}]


def test_step_samples_keep_the_first_groups_their_tokens_and_images_once(tmp_path):
    img = Image.new("RGB", (8, 8), "red")
    pictures = ImageInputs(torch.zeros(1, 2), torch.tensor([[1, 1, 1]]), "abc123",
                           sources=(img,))

    def sample(k):
        return Sample([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.25], [-1, -1, 2, 3],
                      reward=float(k), images=pictures, metadata={"turns": 1, "obj": object()})

    trajs = [Trajectory([sample(0), sample(1)], group_id="a"),
             Trajectory([sample(2)], group_id="b"), Trajectory([sample(3)], group_id="c")]
    record = {1: {"trainer_logprobs": [0.0, 0.0, -0.4, -0.2], "advantages": [0, 0, 1.0, 1.0]},
              2: {"advantages": [0, 0, -1.0, -1.0]}}
    writer = StepSamples(tmp_path, groups=2, decode_pieces=lambda ids: [f"<{i}>" for i in ids])
    path = writer.write(7, 5, trajs, record)
    writer.write(8, 6, trajs, {})
    rows = jsonl(path)
    assert [(r["group"], r["sample"], r["id"]) for r in rows] == [(0, 0, "a"), (0, 1, "a"),
                                                                   (1, 0, "b")]
    r = rows[1]
    assert r["step"] == 7 and r["policy_version"] == 5 and r["tokens"] == ["<1>", "<2>", "<3>",
                                                                            "<4>"]
    assert r["trainer_logprobs"] == [0.0, 0.0, -0.4, -0.2] and r["advantages"][2] == 1.0
    assert rows[0]["trainer_logprobs"] is None and rows[2]["advantages"][3] == -1.0
    assert r["weight_updates"] == [3] and r["metadata"] == {"turns": 1}  # objects left out
    assert r["images"] == ["abc123_0.png"]
    assert [p.name for p in (tmp_path / "samples" / "images").iterdir()] == ["abc123_0.png"]
    assert StepSamples(tmp_path, 0, None).write(9, 0, trajs, {}) is None


def test_the_actor_records_the_trainers_logprobs_of_the_first_groups(tmp_path):
    """What the page calls the trainer's logprobs: those the step started from, equal to a
    forward of the same weights, for the first `record_groups` groups only."""
    path = build_tiny_model(TINY, tmp_path / "m")
    eng = HFTrainEngine.from_pretrained(path, TrainEngineConfig(
        device="cpu", optimizer=OptimizerConfig(lr=1e-2, warmup_steps=0)))
    actor = PPOActor(eng, PPOActorConfig(), record_groups=1)
    groups = [Trajectory([Sample.from_prompt_and_completion([5, 6], c, [-1.0] * len(c),
                                                            [0] * len(c), reward=r)
                          for c, r in zip(([10, 11], [12, 13, 14]), (1.0, 0.0))], group_id=g)
              for g in ("first", "second")]
    before = eng.forward(groups[0].samples)
    actor.train_step(groups)
    record = actor.take_record()
    assert sorted(record) == [0, 1]  # the first group's two samples
    for i, lp in enumerate(before):
        assert record[i]["trainer_logprobs"] == pytest.approx(lp.tolist(), abs=1e-6)
        mask = groups[0].samples[i].loss_mask
        assert [a != 0 for a in record[i]["advantages"]] == [bool(m) for m in mask]
    assert actor.take_record() == {}


# ---- reading run directories ---------------------------------------------------------------------
def test_jsonl_is_read_to_its_last_complete_line_and_bad_lines_are_named(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1}\nnot json\n[1, 2]\n{"step": 2}\n{"step": 3, "rew')
    got = read_lines(f)
    assert [r["step"] for r in got.rows] == [1, 2] and got.partial_tail
    assert got.problems[0].startswith("metrics.jsonl line 2 is not JSON")
    assert "line 3 is a JSON list" in got.problems[1]
    with open(f, "a") as out:  # the writer finishes the line: the next poll gets it
        out.write('ard/mean": 0.5}\n')
    more = read_lines(f, got.offset)
    assert more.rows == [{"step": 3, "reward/mean": 0.5}] and not more.partial_tail
    f.write_text('{"step": 1}\n')  # cut back (a resumed run): start again from 0
    again = read_lines(f, more.offset)
    assert again.reset and again.rows == [{"step": 1}]
    assert read_lines(tmp_path / "missing.jsonl").rows == []


def test_runs_are_found_one_or_two_levels_down(tmp_path):
    for d in ("a", "sweep/b", "sweep/c", "notes"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "a" / "metrics.jsonl").write_text("")
    (tmp_path / "sweep" / "b" / "config.yaml").write_text("{}")
    (tmp_path / "sweep" / "c" / "events.jsonl").write_text("")
    assert list(find_runs(tmp_path)) == ["a", "sweep/b", "sweep/c"]
    assert list(find_runs(tmp_path / "a")) == ["a"]
    with pytest.raises(RunProblem, match="is not a directory"):
        find_runs(tmp_path / "nope")


def test_a_runs_state_comes_from_its_events(tmp_path):
    run = RunDir("r", tmp_path)
    (tmp_path / "config.yaml").write_text("{}")
    assert run.status()["state"] == "running" and "no metrics.jsonl yet" in run.status()["detail"]
    with RunEvents(tmp_path) as events:
        events.emit(EventKind.START, "started")
        events.emit(EventKind.ERROR, "the run stopped at step 2: ValueError: boom")
    assert run.status()["state"] == "failed" and "boom" in run.status()["detail"]
    with RunEvents(tmp_path) as events:
        events.emit(EventKind.RESUME, "resumed")
        events.emit(EventKind.STOP, "stopped by total_steps at step 4")
    assert run.status()["state"] == "finished"
    with pytest.raises(RunProblem, match="recorded no samples"):
        run.samples(1)


# ---- the API over a real server ------------------------------------------------------------------
@pytest.fixture
def served(tmp_path):
    """`create_view_app` under uvicorn on 127.0.0.1 over a root with one small run."""
    run = tmp_path / "runs" / "one"
    (run / "samples").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/greedy_accuracy": 0.1}\n'
                                       '{"step": 1, "reward/mean": 0.5}\n')
    sample = {"tokens": ["a", "b"], "versions": [-1, 0], "loss_mask": [0, 1], "reward": 1.0}
    (run / "samples" / "step_000001.jsonl").write_text(json.dumps(sample) + "\n{broken\n")
    servers = []

    def start(api_key=None):
        app = create_view_app(tmp_path / "runs", api_key)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not (server.started and server.servers):
            assert time.monotonic() < deadline and thread.is_alive(), "view server did not start"
            time.sleep(0.05)
        servers.append((server, thread))
        port = server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def test_the_api_serves_runs_metrics_samples_and_clear_errors(served):
    base = served()
    with httpx.Client(base_url=base) as c:
        page = c.get("/")
        assert page.status_code == 200 and "static/plotly.min.js" in page.text
        js = c.get("/static/plotly.min.js")
        assert js.status_code == 200 and "plotly.js v" in js.text[:200]  # vendored, no CDN
        runs = c.get("/api/runs").json()
        assert [r["name"] for r in runs["runs"]] == ["one"]
        m = c.get("/api/metrics", params={"run": "one"}).json()
        assert [r["step"] for r in m["rows"]] == [0, 1] and m["offset"] > 0
        assert c.get("/api/metrics", params={"run": "one", "offset": m["offset"]}).json()["rows"] == []
        assert c.get("/api/steps", params={"run": "one"}).json() == {"steps": [1]}
        s = c.get("/api/samples", params={"run": "one", "step": 1}).json()
        assert len(s["rows"]) == 1 and "line 2 is not JSON" in s["problems"][0]
        for path, params, status, text in [
                ("/api/metrics", {"run": "two"}, 404, "no run named 'two'"),
                ("/api/samples", {"run": "one", "step": 5}, 404, "recorded steps: 1-1"),
                ("/api/image", {"run": "one", "name": "../../etc/passwd"}, 400, "not an image"),
                ("/static/secret.txt", {}, 404, "no static file")]:
            r = c.get(path, params=params)
            assert r.status_code == status and text in r.json()["error"], (path, r.text)
        bad = c.get("/api/samples", params={"run": "one", "step": "x"})
        assert bad.status_code == 422 and "step" in bad.text


def test_with_a_key_the_data_needs_it_and_the_page_does_not(served):
    base = served(api_key="k3y")
    with httpx.Client(base_url=base) as c:
        assert c.get("/").status_code == 200
        assert c.get("/static/view.js").status_code == 200
        denied = c.get("/api/runs")
        assert denied.status_code == 401 and "asyncrl view --api-key" in denied.text
        assert c.get("/api/runs", headers={"Authorization": "Bearer k3y"}).status_code == 200
        assert c.get("/api/runs", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_view_refuses_other_hosts_without_a_key_and_names_the_fix(tmp_path):
    with pytest.raises(UserError, match="--api-key"):
        view(tmp_path, host="0.0.0.0")
    cli = subprocess.run([sys.executable, "-m", "asyncrl.cli", "view", str(tmp_path / "nope"),
                          "--port", "0"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2 and "is not a directory" in cli.stderr


def test_the_screenshot_script_shows_the_group_weight_updates_reached_most(tmp_path):
    """benchmarks/view_screenshots.py opens the step whose recorded samples weight updates
    reached most often, on the group they reached most (the docs' token screenshot)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from view_screenshots import busiest_step

    (tmp_path / "samples").mkdir()

    def write(step: int, updates_by_group: dict[int, list[int]]) -> None:
        rows = [{"step": step, "group": g, "weight_updates": u} for g, u in updates_by_group.items()]
        (tmp_path / "samples" / f"step_{step:06d}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))

    write(1, {0: [], 1: [], 2: []})
    write(2, {0: [], 1: [5], 2: [5, 6], 3: [7]})
    write(3, {0: [4], 1: []})
    assert busiest_step(tmp_path) == (2, 2)
    for p in (tmp_path / "samples").glob("step_00000[23].jsonl"):
        p.unlink()
    assert busiest_step(tmp_path) == (1, 0)  # no update anywhere: the first step's first group
