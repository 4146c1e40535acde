"""Evaluation: the pass@k estimator, `evaluate` on the real in-process engine and on a scripted
engine with known answers, finding the model in run/checkpoint dirs, and `asyncrl eval` as a user
runs it."""

import asyncio
import itertools
import json
import math
import subprocess
import sys
from fractions import Fraction

import pytest
from conftest import TINY

from asyncrl.api import ModelResponse, StopReason
from asyncrl.config import ConfigError
from asyncrl.data.split import DatasetError
from asyncrl.errors import UserError
from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig
from asyncrl.launch.evaluate import load_eval_rows, parse_k_list
from asyncrl.rollout.answer_eval import EvalConfig, evaluate, pass_at_k
from asyncrl.launch.run_checkpoints import find_policy_dir
from asyncrl.models.loading import load_tokenizer
from asyncrl.models.tiny import build_tiny_model
from asyncrl.reward.config import open_reward

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- pass@k ------------------------------------------------------------------------------


@pytest.mark.parametrize("n,c,k,want", [
    (1, 0, 1, 0.0), (1, 1, 1, 1.0), (2, 1, 1, 0.5), (10, 3, 1, 0.3),
    (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (8, 0, 8, 0.0), (8, 1, 8, 1.0), (8, 7, 2, 1.0), (1000, 1, 1, 0.001),
])
def test_pass_at_k_hand_values(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_equals_brute_force_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                want = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    n, c, k = 500, 7, 100  # C(500, 100) has 107 digits: no float overflow in the product form
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


@pytest.mark.parametrize("n,c,k,needle", [
    (4, 1, 5, "k=5"), (4, 5, 1, "c=5"), (-1, 0, 1, "n=-1"), (4, -1, 1, "c=-1"),
    (4, 1, -2, "k=-2"), (4, 1, 0, "k=0"),
])
def test_pass_at_k_rejects_bad_arguments(n, c, k, needle):
    with pytest.raises(ValueError, match=needle):
        pass_at_k(n, c, k)


# ---- config ------------------------------------------------------------------------------


def test_eval_config_validation():
    assert EvalConfig().samples_per_problem == 0
    cfg = EvalConfig(pass_k=[8, 1, 4, 4])
    assert cfg.pass_k == [1, 4, 8] and cfg.samples_per_problem == 8
    assert EvalConfig(pass_k=[2], num_samples=6).samples_per_problem == 6
    with pytest.raises(ConfigError, match=r"num_samples=3 is smaller than max\(pass_k\)=4"):
        EvalConfig.from_dict({"pass_k": [1, 4], "num_samples": 3})
    with pytest.raises(ConfigError, match=r"pass_k=\[0, 2\]: each k must be >= 1"):
        EvalConfig.from_dict({"pass_k": [0, 2]})
    with pytest.raises(ConfigError, match="temperature=0"):
        EvalConfig.from_dict({"temperature": 0})
    with pytest.raises(ConfigError, match="did you mean 'pass_k'"):
        EvalConfig.from_dict({"pass_at": [1]})
    assert parse_k_list("1,4,8") == [1, 4, 8]
    for bad in ("", "1,,2", "a", "0", "1,-4"):
        with pytest.raises(UserError, match="--k"):
            parse_k_list(bad)


# ---- evaluate ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    with AsyncLLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=64,
                                     max_num_seqs=16)) as eng:
        yield eng


def make_rows(answers):
    return [{"id": f"p{i}", "question": f"{i}+{i}=", "answer": a,
             "messages": [{"role": "user", "content": f"{i}+{i}="}]}
            for i, a in enumerate(answers)]


class RecordingEngine:
    """Forwards to a real engine and records every request, its response and the peak number of
    requests in flight."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []
        self.in_flight = self.peak = 0

    async def agenerate(self, req):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            resp = await self.inner.agenerate(req)
        finally:
            self.in_flight -= 1
        self.calls.append((req, resp))
        return resp

    def get_version(self):
        return self.inner.get_version()


def test_evaluate_exact_accuracy_from_a_row_flag_reward(engine, tokenizer):
    rows = make_rows(["yes", "no", "yes", "yes", "no"])
    progress = []
    result = asyncio.run(evaluate(
        engine, tokenizer, rows, lambda text, row: float(row["answer"] == "yes"),
        EvalConfig(pass_k=[1, 2, 4], max_new_tokens=4),
        on_progress=lambda done, total: progress.append((done, total))))
    assert result.greedy_accuracy == pytest.approx(0.6)
    assert result.pass_at_k == pytest.approx({1: 0.6, 2: 0.6, 4: 0.6})
    assert result.mean_sample_reward == pytest.approx(0.6)
    assert result.num_problems == 5 and result.seconds > 0
    assert [(r.id, r.num_correct, r.num_samples) for r in result.records] == [
        ("p0", 4, 4), ("p1", 0, 4), ("p2", 4, 4), ("p3", 4, 4), ("p4", 0, 4)]
    assert progress == [(d, 5) for d in range(1, 6)]
    assert result.summary() == pytest.approx({
        "eval/greedy_accuracy": 0.6, "eval/pass@1": 0.6, "eval/pass@2": 0.6, "eval/pass@4": 0.6,
        "eval/mean_sample_reward": 0.6, "eval/num_problems": 5.0,
        "eval/seconds": result.seconds})


def test_evaluate_on_the_real_engine_matches_its_own_samples(engine, tokenizer):
    """Greedy text is what a direct greedy request returns; pass@k is the estimator applied to
    the samples the engine really produced; seeds are distinct; concurrency is bounded."""
    rows = make_rows(["1", "2", "3", "4", "5", "6"])
    good = set("abcdefghijklmnopqrstuvwxyz")  # reward 1 when the completion starts lowercase

    def reward(text, row):
        return 1.0 if text[:1] in good else 0.0

    rec = RecordingEngine(engine)
    cfg = EvalConfig(pass_k=[1, 3], num_samples=5, temperature=2.0, max_new_tokens=5,
                     concurrency=4)
    result = asyncio.run(evaluate(rec, tokenizer, rows, reward, cfg))

    assert len(rec.calls) == 6 * (1 + 5) and 1 < rec.peak <= 4
    assert all(req.gconfig.n_samples == 1 for req, _ in rec.calls)
    sampled = [(req, resp) for req, resp in rec.calls if not req.gconfig.greedy]
    assert len({req.gconfig.seed for req, _ in sampled}) == len(sampled) == 30
    assert all(req.gconfig.temperature == 2.0 for req, _ in sampled)

    texts_by_prompt = {}
    for req, resp in sampled:
        texts_by_prompt.setdefault(tuple(req.input_ids), []).append(
            tokenizer.decode(resp.output_tokens, skip_special_tokens=True))
    from asyncrl.api import GenerationConfig, ModelRequest
    from asyncrl.models.chat import encode_chat_prompt

    counts = []
    for row, record in zip(rows, result.records):
        ids = encode_chat_prompt(tokenizer, row["messages"])
        direct = asyncio.run(engine.agenerate(ModelRequest(ids, GenerationConfig(
            greedy=True, max_new_tokens=5, stop_token_ids=[tokenizer.eos_token_id]))))
        assert record.greedy_completion == tokenizer.decode(direct.output_tokens,
                                                            skip_special_tokens=True)
        assert record.greedy_reward == reward(record.greedy_completion, row)
        counts.append(sum(reward(t, row) == 1.0 for t in texts_by_prompt[tuple(ids)]))
        assert record.num_correct == counts[-1]
    assert 0 < sum(counts) < 30, "the reward should split the samples for a meaningful check"
    for k in (1, 3):
        assert result.pass_at_k[k] == pytest.approx(sum(pass_at_k(5, c, k) for c in counts) / 6)
    assert result.greedy_accuracy == pytest.approx(
        sum(r.greedy_reward for r in result.records) / 6)

    again = asyncio.run(evaluate(engine, tokenizer, rows, reward, cfg))  # seeded: reproducible
    assert [r.num_correct for r in again.records] == counts


class ScriptedEngine:
    """Answers "1" (correct) or "0": greedy correct for the problems in `greedy_ok`; of the
    sampled requests of problem i, the first `sample_ok[i]` are correct."""

    def __init__(self, tokenizer, rows, greedy_ok, sample_ok):
        from asyncrl.models.chat import encode_chat_prompt

        self.tok = tokenizer
        self.index = {tuple(encode_chat_prompt(tokenizer, r["messages"])): i
                      for i, r in enumerate(rows)}
        self.greedy_ok, self.sample_ok = greedy_ok, list(sample_ok)

    async def agenerate(self, req):
        await asyncio.sleep(0)
        i = self.index[tuple(req.input_ids)]
        if req.gconfig.greedy:
            ok = i in self.greedy_ok
        else:
            ok = self.sample_ok[i] > 0
            self.sample_ok[i] -= 1
        out = self.tok.encode("1" if ok else "0", add_special_tokens=False)
        return ModelResponse(list(req.input_ids), out, [0.0] * len(out), [0] * len(out),
                             StopReason.STOP, rid=req.rid)

    def get_version(self):
        return 0


def test_evaluate_pass_at_k_exact_with_known_correct_counts(tokenizer):
    rows = make_rows(["1"] * 4)
    engine = ScriptedEngine(tokenizer, rows, greedy_ok={0, 3}, sample_ok=[0, 1, 2, 4])

    def reward(text, row):
        return 1.0 if text == row["answer"] else 0.0

    result = asyncio.run(evaluate(engine, tokenizer, rows, reward,
                                  EvalConfig(pass_k=[1, 2, 4], concurrency=3)))
    assert [r.num_correct for r in result.records] == [0, 1, 2, 4]
    assert result.greedy_accuracy == 0.5
    # n = 4: pass@1 = c/4; pass@2 = 1 - C(4-c,2)/6 -> 0, 1/2, 5/6, 1; pass@4 = [c > 0]
    assert result.pass_at_k[1] == pytest.approx((0 + 0.25 + 0.5 + 1) / 4)
    assert result.pass_at_k[2] == pytest.approx((0 + 0.5 + 5 / 6 + 1) / 4)
    assert result.pass_at_k[4] == pytest.approx(0.75)
    assert result.mean_sample_reward == pytest.approx(7 / 16)


def test_evaluate_async_reward_and_threshold(tokenizer):
    rows = make_rows(["1"] * 2)
    engine = ScriptedEngine(tokenizer, rows, greedy_ok={0, 1}, sample_ok=[2, 0])

    async def reward(text, row):  # shaped: 0.6 counts as correct, 0.4 does not
        await asyncio.sleep(0)
        return 0.6 if text == "1" else 0.4

    result = asyncio.run(evaluate(engine, tokenizer, rows, reward, EvalConfig(pass_k=[2])))
    assert result.greedy_accuracy == 1.0
    assert [r.num_correct for r in result.records] == [2, 0]
    assert result.pass_at_k == {2: 0.5}
    assert result.mean_sample_reward == pytest.approx(0.5)


def test_evaluate_greedy_only_reports_no_samples(tokenizer):
    rows = make_rows(["1"] * 3)
    engine = ScriptedEngine(tokenizer, rows, greedy_ok={1}, sample_ok=[0, 0, 0])
    result = asyncio.run(evaluate(engine, tokenizer, rows, lambda t, r: float(t == "1"),
                                  EvalConfig()))
    assert result.greedy_accuracy == pytest.approx(1 / 3)
    assert result.pass_at_k == {} and result.mean_sample_reward is None
    assert "eval/pass@1" not in result.summary()
    with pytest.raises(ValueError, match="rows is empty"):
        asyncio.run(evaluate(engine, tokenizer, [], lambda t, r: 0.0, EvalConfig()))


def test_evaluate_names_the_problem_the_engine_refuses(engine, tokenizer):
    rows = make_rows(["1", "2"])
    rows[1]["messages"] = [{"role": "user", "content": "9" * 80}]  # over max_seq_len=64
    rec = RecordingEngine(engine)
    with pytest.raises(ValueError, match="eval problem p1: prompt .* max_seq_len=64"):
        asyncio.run(evaluate(rec, tokenizer, rows, lambda t, r: 0.0,
                             EvalConfig(pass_k=[4], max_new_tokens=4)))
    assert rec.in_flight == 0  # the other workers were cancelled and their requests ended


def test_math_reward_runs_math_verify_in_the_pool():
    with open_reward("math") as reward:
        assert asyncio.run(reward("so #### 1/2", {"answer": "0.5"})) == 1.0
        assert asyncio.run(reward("#### 3", {"answer": "0.5"})) == 0.0
        # what a training run logs after each step: how calls ended, the pool's health
        metrics = reward.metrics()
        assert metrics["reward/math/ok"] == 2.0 and metrics["reward/math/worker_restarts"] == 0
        assert metrics["reward/math/latency_s"] > 0


# ---- finding the model, reading the data -------------------------------------------------


def fake_model_dir(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_find_policy_dir_layouts(tmp_path):
    hf = fake_model_dir(tmp_path / "hf")
    assert find_policy_dir(hf) == hf
    ckpt = tmp_path / "ckpt"
    fake_model_dir(ckpt / "policy")
    (ckpt / "trainer").mkdir()
    assert find_policy_dir(ckpt) == ckpt / "policy"

    run = tmp_path / "run"
    for step in (50, 200, 150):
        fake_model_dir(run / "checkpoints" / f"step_{step:06d}" / "policy")
        (run / "checkpoints" / f"step_{step:06d}" / "state.json").write_text("{}")
    fake_model_dir(run / "checkpoints" / "step_000250" / "policy")  # no state.json: incomplete
    (run / "checkpoints" / ".step_000300.tmp").mkdir()  # a half-written save is ignored
    assert find_policy_dir(run) == run / "checkpoints" / "step_000200" / "policy"
    (run / "checkpoints" / "latest").write_text("step_000150\n")
    assert find_policy_dir(str(run)) == run / "checkpoints" / "step_000150" / "policy"
    # the checkpoint a resume would take: a stale `latest` falls back to the newest complete one
    (run / "checkpoints" / "latest").write_text("step_000999\n")
    assert find_policy_dir(run) == run / "checkpoints" / "step_000200" / "policy"
    broken = tmp_path / "broken"
    (broken / "checkpoints" / "step_000010" / "trainer").mkdir(parents=True)
    (broken / "checkpoints" / "step_000010" / "state.json").write_text("{}")
    with pytest.raises(UserError, match="step_000010 has no policy/config.json"):
        find_policy_dir(broken)
    with pytest.raises(UserError, match="looked for .*config.json.*policy/config.json.*step_"):
        find_policy_dir(tmp_path)
    with pytest.raises(UserError, match="not found"):
        find_policy_dir(tmp_path / "nope")


def test_load_eval_rows(tmp_path):
    good = tmp_path / "gsm.jsonl"
    good.write_text('{"question": "a?", "answer": "work\\n#### 1,000"}\n'
                    '{"question": "b?", "answer": 7}\n')
    rows = load_eval_rows(str(good))
    assert [(r["question"], r["answer"]) for r in rows] == [("a?", "1000"), ("b?", "7")]
    assert rows[0]["messages"] == [{"role": "user", "content": "a?"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a?", "answer": "1"}\n{"answer": "2"}\n')
    with pytest.raises(DatasetError, match="row 1: missing field 'question'"):
        load_eval_rows(str(bad))
    with pytest.raises(UserError, match="allowed: arithmetic"):
        load_eval_rows(str(tmp_path / "x.csv"))
    assert len(load_eval_rows("arithmetic")) == 500


def test_load_eval_rows_from_a_dataset_mapping(tmp_path):
    """--data takes the run config's dataset forms inline: here `kind: hf` on a local folder with
    a test split, nested answers and a system prompt; mistakes name the field."""
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "train.jsonl").write_text('{"q": "x?", "meta": {"gt": 1}}\n')
    (tmp_path / "ds" / "test.jsonl").write_text('{"q": "a?", "meta": {"gt": 2}}\n'
                                                '{"q": "b?", "meta": {"gt": 3}}\n')
    rows = load_eval_rows(f"{{kind: hf, name: {tmp_path / 'ds'}, eval_split: test, "
                          f"question_field: q, answer_field: meta.gt, system_prompt: Be brief.}}")
    assert [(r["question"], r["answer"]) for r in rows] == [("a?", "2"), ("b?", "3")]
    assert rows[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    with pytest.raises(ConfigError, match="--data: dataset kind='hff' is not known; allowed:"):
        load_eval_rows("{kind: hff, name: x}")
    with pytest.raises(UserError, match="malformed YAML"):
        load_eval_rows("{kind: hf, name: [x}")


# ---- the command -------------------------------------------------------------------------


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", "eval", *map(str, args)],
                          capture_output=True, text=True, timeout=300, check=False)


def test_cli_eval_end_to_end(tmp_path):
    model = build_tiny_model(TINY, tmp_path / "run" / "checkpoints" / "step_000007" / "policy")
    (model.parent / "state.json").write_text("{}")  # what marks a checkpoint complete
    data = tmp_path / "five.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(5)))
    out = tmp_path / "out" / "eval.json"
    proc = run_cli(tmp_path / "run", "--data", data, "--k", "1,2", "--max-new-tokens", "4",
                   "--json", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for needle in ("problems", "greedy accuracy", "pass@1", "pass@2", "problems/s", str(model)):
        assert needle in proc.stdout, proc.stdout
    dump = json.loads(out.read_text())
    assert dump["model"] == str(model) and dump["config"]["pass_k"] == [1, 2]
    assert [p["answer"] for p in dump["problems"]] == ["1", "2", "3", "4", "5"]
    assert all(p["num_samples"] == 2 for p in dump["problems"])
    assert dump["summary"]["eval/num_problems"] == 5.0
    assert set(dump["summary"]) >= {"eval/greedy_accuracy", "eval/pass@1", "eval/pass@2"}


@pytest.mark.parametrize("flags,needle", [
    (["--k", "1,x"], "--k='1,x'"),
    (["--k", "4", "--num-samples", "2"], "num_samples=2 is smaller than max(pass_k)=4"),
])
def test_cli_eval_bad_flags_give_one_line(tmp_path, flags, needle):
    proc = run_cli(tmp_path, "--data", "arithmetic", *flags)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("asyncrl eval: error:"), lines
    assert needle in lines[0]
    if "--k" in needle:
        assert "integers >= 1" in lines[0]


def test_open_reward_names_dotted_paths_and_errors():
    with open_reward("exact") as reward:
        assert reward("the answer is 12", {"answer": "12"}) == 1.0
    with open_reward("asyncrl.reward.exact:exact_answer_reward") as reward:
        # a user's sync function comes back wrapped to run on a thread pool: awaited
        assert asyncio.run(reward("12", "12")) == 1.0
    for bad, words in (("nope", "allowed: exact, digits, clevr_count_70k, math"), ("no_such_mod:f", "no module 'no_such_mod'.*PYTHONPATH"),
                       ("asyncrl.reward.exact:missing", "has no 'missing'")):
        with pytest.raises(UserError, match=words):
            with open_reward(bad):
                pass


def test_eval_job_runs_inside_a_running_event_loop(tmp_path):
    """A notebook cell runs inside an event loop: `run_eval_job` used to call `asyncio.run`
    there and fail ("cannot be called from a running event loop")."""
    import asyncio
    import io

    from rich.console import Console

    from asyncrl.launch.evaluate import run_eval_job
    from asyncrl.rollout.answer_eval import EvalConfig

    model = build_tiny_model(TINY, tmp_path / "m")
    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(3)))

    async def cell():
        return run_eval_job(model, str(data), EvalConfig(max_new_tokens=3),
                            console=Console(file=io.StringIO()), max_num_seqs=4)

    result = asyncio.run(cell())
    assert len(result.records) == 3
