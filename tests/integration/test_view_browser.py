"""`asyncrl view` in a real browser: a headless Chromium from the OS packages (Debian's chromium
and chromium-driver, which `.ci/run` installs; nothing is downloaded at run time) driven by
Selenium over a real `asyncrl view` subprocess, over real run directories that real `Trainer`
runs wrote: a text run with weight updates landing mid-generation, a multi-turn run (the
conversation view) and a vision-language run (prompt images), next to damaged copies (a
malformed metrics line, a truncated tail, a run with no metrics yet). Screenshots land in
$ASYNCRL_SCREENSHOTS (default runs/view_screenshots) for a person to look at.

Marker `browser`: `python -m pytest -q -m browser tests/integration`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_loop import metrics, small_config
from train_helpers import digit_reward

from asyncrl import Trainer
from asyncrl.api import Trajectory
from asyncrl.api.trajectory import Sample
from asyncrl.launch.step_samples import StepSamples
from asyncrl.launch.train_config import TrainRunConfig
from asyncrl.models.presets import build_preset_model

from headless_chromium import ROOT, chromium, screenshot_dir  # noqa: E402  (skips if absent)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]


def samples_of(run: Path, step: int) -> list[dict]:
    return [json.loads(x) for x in (run / "samples" / f"step_{step:06d}.jsonl").read_text()
            .splitlines()]


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> Path:
    """ROOT/text, ROOT/multi_turn, ROOT/vision written by real runs; ROOT/damaged and
    ROOT/fresh damaged or unfinished on purpose."""
    root = tmp_path_factory.mktemp("view") / "runs"
    # long generations, two at a time, at eta 2: the engine is never idle, so every push lands
    # while sequences are being generated; logging.sample_groups 3 of the batch's 4 groups
    Trainer(small_config(model_dir, root / "text", total_steps=6, checkpoint_every=2,
                         **{"gconfig.max_new_tokens": 96, "rollout.max_head_offpolicyness": 2,
                            "inference.engine.max_num_seqs": 2, "logging.sample_groups": 3})
            ).train(reward=digit_reward)
    cfg = TrainRunConfig.load(str(ROOT / "configs" / "train_multiturn.yaml"), [
        f"model.path={model_dir}", f"output_dir={root / 'multi_turn'}", "total_steps=2",
        "max_train_seconds=null", "gconfig.n_samples=2", "gconfig.max_new_tokens=4",
        "rollout.batch_size=2", "rollout.max_concurrent_rollouts=4",
        "filter_uniform_groups=false", "eval.every=0", "logging.tensorboard=false",
        "inference.engine.max_num_seqs=16"])
    Trainer(cfg).train(reward=digit_reward)
    vl = build_preset_model("tiny-vl", root.parent / "tiny-vl")
    Trainer(small_config(vl, root / "vision", total_steps=2, checkpoint_every=0, **{
        "data": {"kind": "counting", "num_train": 32, "num_eval": 4, "max_objects": 3},
        "gconfig.max_new_tokens": 3, "eval.every": 0})).train()
    # an agent's episode as the proxy exports it (concat): model turns with a tool call, the
    # tool's result between them, a reward per turn; written by the run's own writer
    text = ["<|im_start|>user\nAdd 2 and 3<|im_end|>\n<|im_start|>assistant\n",
            '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>',
            "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", "5<|im_end|>"]
    pieces = [c for part in text for c in part]
    mask = [m for part, m in zip(text, (0, 1, 0, 1)) for _ in part]
    ends = [sum(len(p) for p in text[:i + 1]) - 1 for i in range(4)]
    rewards = [0.0] * len(pieces)
    rewards[ends[1]], rewards[ends[3]] = 0.5, 1.0
    episode = Sample(list(range(len(pieces))), mask, [-0.5 * m for m in mask],
                     [3 * m - (1 - m) for m in mask], reward=1.0, token_rewards=rewards,
                     metadata={"turns": 2, "tool_calls": 1})
    StepSamples(root / "agent", 1, lambda ids: [pieces[i] for i in ids]).write(
        4, 3, [Trajectory([episode], group_id="add-2-3")], {})
    # with the tool metrics a tool_calls run logs (asyncrl/rollout/tool_calling.py)
    (root / "agent" / "metrics.jsonl").write_text(json.dumps({
        "step": 4, "reward/mean": 1.0, "tools/calls": 8.0, "tools/errors_timeout": 1.0,
        "tools/errors_server_error": 0.0, "tools/latency_p50_s": 0.5,
        "tools/latency_p99_s": 2.5}) + "\n")
    damaged = root / "damaged"
    shutil.copytree(root / "text", damaged, ignore=shutil.ignore_patterns("checkpoints"))
    lines = (damaged / "metrics.jsonl").read_text().splitlines()
    lines.insert(2, "this line is not json")
    (damaged / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 99, "reward/me')
    step_file = damaged / "samples" / "step_000002.jsonl"
    step_file.write_text(step_file.read_text()[:-200])  # cut inside the last sample
    (root / "fresh").mkdir()
    (root / "fresh" / "config.yaml").write_text("{}\n")
    return root


def start_view(root: Path) -> tuple[subprocess.Popen, str]:
    """`asyncrl view ROOT --port 0` as a user runs it; its first line names the URL."""
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "view", str(root),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    if not line.startswith("asyncrl view: http://"):
        proc.kill()
        pytest.fail(f"asyncrl view did not start: {line!r} {proc.stderr.read()[-2000:]}")
    return proc, line.split(": ", 1)[1].strip()


@pytest.fixture(scope="module")
def view_url(runs):
    proc, url = start_view(runs)
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def browser():
    yield from chromium()


@pytest.fixture(scope="module")
def shots() -> Path:
    return screenshot_dir()


def wait_for(driver, condition, what: str, timeout: float = 60):
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: condition(d))
    except Exception:
        messages = [m.text for m in driver.find_elements(By.CSS_SELECTOR, "#messages .message")]
        pytest.fail(f"the page never showed {what}; its messages: {messages}")


def test_curves_have_one_point_per_recorded_step_and_events_on_the_timeline(
        browser, view_url, runs, shots):
    browser.get(view_url)
    wait_for(browser, lambda d: d.find_element(By.ID, "charts").get_attribute("data-drawn"),
             "its curves")
    # every run's reward curve point is a step of its metrics.jsonl (the damaged copy's bad
    # line and cut tail skipped); the held-out curve has one point per evaluation
    rewards = sum(sum(1 for m in metrics(runs / n) for k in ("reward/mean", "reward/all_mean")
                      if k in m) for n in ("text", "multi_turn", "vision", "text", "agent"))
    chart = browser.find_element(By.ID, "chart-reward")
    wait_for(browser, lambda d: int(chart.get_attribute("data-points")) == rewards,
             f"{rewards} reward points")
    evals = sum(1 for m in metrics(runs / "text") if "eval/greedy_accuracy" in m)
    assert evals >= 3
    plotted = browser.execute_script(
        "return document.getElementById('chart-eval').data.map(t => [t.name, t.x]);")
    text_eval = [x for name, x in plotted if name == "text eval/greedy_accuracy"]
    assert text_eval == [[m["step"] for m in metrics(runs / "text")
                          if "eval/greedy_accuracy" in m]]
    for chart_id in ("staleness", "staleness_hist", "mismatch", "throughput", "sync", "tools",
                     "tool_latency"):
        assert int(browser.find_element(By.ID, f"chart-{chart_id}").get_attribute(
            "data-points")) > 0, chart_id
    # checkpoints and the stop are on the timeline chart
    kinds = browser.execute_script(
        "return document.getElementById('chart-timeline').data.flatMap(t => t.y);")
    assert {"start", "eval", "checkpoint", "stop"} <= set(kinds)
    # the damaged run says what is wrong with it; the unfinished one that it has no metrics
    messages = " | ".join(m.text for m in browser.find_elements(By.CSS_SELECTOR,
                                                                "#messages .message"))
    assert "run damaged: metrics.jsonl line 3 is not JSON" in messages, messages
    assert "run fresh has no metrics yet" in messages, messages
    states = {c.get_attribute("data-run"): c.find_element(By.CLASS_NAME, "state").text
              for c in browser.find_elements(By.CSS_SELECTOR, "#runs .run")}
    assert states["text"] == "finished" and set(states) == {"text", "multi_turn", "vision",
                                                             "damaged", "fresh", "agent"}
    browser.save_screenshot(str(shots / "curves.png"))


def tokens_on_page(browser) -> list[tuple[int, int, int]]:
    """(sample, token index, version) of every generated token the page shows."""
    return browser.execute_script("""
        return [...document.querySelectorAll('.sample')].flatMap(s =>
          [...s.querySelectorAll('.tok:not(.context)')].map(t =>
            [Number(s.dataset.sample) + 1000 * Number(s.closest('.group').dataset.group),
             Number(t.dataset.i), Number(t.dataset.version)]));""")


def test_a_steps_tokens_carry_the_recorded_versions_and_weight_updates(browser, view_url, runs,
                                                                         shots):
    steps = sorted(int(p.stem.split("_")[1]) for p in (runs / "text" / "samples").iterdir()
                   if p.suffix == ".jsonl")
    assert steps == [1, 2, 3, 4, 5, 6]
    # the step whose samples a weight update reached most often
    step = max(steps, key=lambda s: sum(len(r["weight_updates"]) for r in samples_of(
        runs / "text", s)))
    rows = samples_of(runs / "text", step)
    updates = sum(len(r["weight_updates"]) for r in rows)
    assert updates > 0, "no weight update landed mid-generation in 6 steps at eta 2"
    browser.get(f"{view_url}?tab=samples&run=text&step={step}")
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".sample .tok"),
             "the step's tokens")
    expected = sorted((r["sample"] + 1000 * r["group"], i, v) for r in rows
                      for i, (v, m) in enumerate(zip(r["versions"], r["loss_mask"])) if m)
    assert sorted(map(tuple, tokens_on_page(browser))) == expected
    assert len(browser.find_elements(By.CSS_SELECTOR, ".tokens .update")) == updates
    assert len(browser.find_elements(By.CSS_SELECTOR, ".group")) == 3  # logging.sample_groups
    browser.save_screenshot(str(shots / "trajectories_by_version.png"))
    # second colouring: |trainer - sampler| on every token the trainer recorded
    Select(browser.find_element(By.ID, "colour")).select_by_value("mismatch")
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".tok[data-diff]"),
             "the mismatch colouring")
    shown = browser.execute_script("""
        return [...document.querySelectorAll('.tok[data-diff]')].map(t =>
          [Number(t.closest('.sample').dataset.sample) +
           1000 * Number(t.closest('.group').dataset.group), Number(t.dataset.i),
           Number(t.dataset.diff)]);""")
    recorded = {(r["sample"] + 1000 * r["group"], i): abs(t - s) for r in rows
                if r["trainer_logprobs"] for i, (t, s, m) in enumerate(zip(
                    r["trainer_logprobs"], r["sampler_logprobs"], r["loss_mask"])) if m}
    assert len(shown) == len(recorded)
    for key_a, key_b, diff in shown:
        assert diff == pytest.approx(recorded[(key_a, key_b)], abs=1e-9)
    browser.save_screenshot(str(shots / "trajectories_by_mismatch.png"))
    # the reward filter leaves only the samples it passes
    browser.find_element(By.ID, "rmin").send_keys("0.5")
    kept = sum(1 for r in rows if r["reward"] >= 0.5)
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".sample")) == kept,
             f"{kept} samples with reward >= 0.5")


def test_a_multi_turn_episode_is_a_conversation_and_a_vlm_prompt_shows_its_image(
        browser, view_url, runs, shots):
    rows = samples_of(runs / "multi_turn", 2)
    model_turns = sum(1 for r in rows for t in r["turns"] if t["role"] == "model")
    browser.get(f"{view_url}?tab=samples&run=multi_turn&step=2")
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".sample"), "the samples")
    # single-turn episodes show their tokens; multi-turn ones one bubble per model turn
    shown_turns = len(browser.find_elements(By.CSS_SELECTOR, ".turn.model"))
    assert shown_turns == sum(sum(1 for t in r["turns"] if t["role"] == "model")
                              for r in rows if len(r["turns"]) > 2)
    assert model_turns >= len(rows)
    browser.save_screenshot(str(shots / "multi_turn.png"))
    browser.get(f"{view_url}?tab=samples&run=agent&step=4")
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".turn.model"), "the turns")
    turns = [t.find_element(By.CLASS_NAME, "role").text for t in
             browser.find_elements(By.CSS_SELECTOR, ".turn")]
    assert turns == ["model turn 1 · reward 0.5", "context (user, tool or environment tokens)",
                     "model turn 2 · reward 1"]
    assert [c.text for c in browser.find_elements(By.CLASS_NAME, "tool-call")] == [
        'tool call: add({"a":2,"b":3})']
    browser.save_screenshot(str(shots / "agent.png"))
    browser.get(f"{view_url}?tab=samples&run=vision&step=1")
    wait_for(browser, lambda d: any(i.get_attribute("naturalWidth") not in (None, "0")
                                    for i in d.find_elements(By.CSS_SELECTOR, ".images img")),
             "a prompt image")
    names = {i.get_attribute("data-name") for i in
             browser.find_elements(By.CSS_SELECTOR, ".images img")}
    assert names == {n for r in samples_of(runs / "vision", 1) for n in r["images"]}
    browser.save_screenshot(str(shots / "vision.png"))


def test_a_damaged_step_and_the_events_table_say_what_they_hold(browser, view_url, runs, shots):
    browser.get(f"{view_url}?tab=samples&run=damaged&step=2")
    wait_for(browser, lambda d: "step_000002.jsonl ends inside a line" in d.find_element(
        By.ID, "messages").text, "the truncated step's message")
    shown = len(browser.find_elements(By.CSS_SELECTOR, ".sample"))
    assert shown == len(samples_of(runs / "text", 2)) - 1  # all but the one cut
    browser.get(f"{view_url}?tab=events")
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#events-table tr.event"),
             "the events")
    kinds = [r.get_attribute("class").split()[1] for r in
             browser.find_elements(By.CSS_SELECTOR, "#events-table tr.event")]
    recorded = sum(1 for n in ("text", "multi_turn", "vision", "damaged")
                   for _ in (runs / n / "events.jsonl").read_text().splitlines())
    assert len(kinds) == recorded and {"start", "eval", "checkpoint", "stop"} <= set(kinds)
    browser.save_screenshot(str(shots / "events.png"))
    started = time.monotonic()
    browser.get(f"{view_url}api/metrics?run=nope")
    assert "no run named 'nope'" in browser.page_source and time.monotonic() - started < 60


def test_curves_follow_a_run_that_is_still_writing(browser, runs, tmp_path):
    """The page polls: lines a run appends (half a line first, as a writer mid-flush) reach
    the curves without a reload."""
    live = tmp_path / "live"
    live.mkdir()
    lines = (runs / "text" / "metrics.jsonl").read_text().splitlines(keepends=True)
    (live / "metrics.jsonl").write_text("".join(lines[:2]))
    proc, url = start_view(live)
    try:
        browser.get(url)

        def points(d):
            return int(d.find_element(By.ID, "chart-reward").get_attribute("data-points") or 0)

        def expected(upto):
            return sum(1 for x in lines[:upto] for k in ("reward/mean", "reward/all_mean")
                       if k in json.loads(x))

        wait_for(browser, lambda d: points(d) == expected(2), "the first lines' points")
        with open(live / "metrics.jsonl", "a") as f:
            f.write(lines[2][:10])
            f.flush()
            wait_for(browser, lambda d: d.find_element(By.ID, "runs").text, "the run card")
            f.write(lines[2][10:] + "".join(lines[3:]))
        wait_for(browser, lambda d: points(d) == expected(len(lines)),
                 f"all {expected(len(lines))} points")
    finally:
        proc.terminate()
        proc.wait(30)
