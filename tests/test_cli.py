"""The `asyncrl` command as a user runs it: real subprocesses, one-line errors, no tracebacks."""

import json
from pathlib import Path
import os
import subprocess
import sys

import pytest

TINY_MODEL = [
    "tiny.hidden_size=64", "tiny.num_layers=2", "tiny.num_heads=2", "tiny.num_kv_heads=1",
    "tiny.intermediate_size=128",
    "sft.steps=3", "sft.batch_size=8", "sft.eval_size=8", "sft.eval_max_new_tokens=4",
]
TINY = TINY_MODEL + ["data.num_train=200", "data.num_eval=20"]


def run_cli(args, tmp_path, check_rc=None):
    env = dict(os.environ, ASYNCRL_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stderr[-3000:]
    return proc


def assert_one_clean_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    err_lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(err_lines) == 1, proc.stderr
    for needle in needles:
        assert needle in err_lines[0], err_lines[0]


@pytest.mark.slow
def test_sft_runs_end_to_end_and_caches(tmp_path):
    out = tmp_path / "sft_out"
    first = run_cli(["sft", *TINY, f"output_dir={out}"], tmp_path, check_rc=0)
    assert "cached=False" in first.stdout
    result = json.loads((out / "sft_result.json").read_text())
    assert 0.0 <= result["eval_accuracy"] <= 1.0 and result["steps"] == 3
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    second = run_cli(["sft", *TINY, f"output_dir={out}"], tmp_path, check_rc=0)
    assert "cached=True" in second.stdout


@pytest.mark.slow
def test_sft_under_torchrun_trains_sharded_and_matches_one_process(tmp_path):
    """`asyncrl sft` on 2 gloo ranks (FSDP2 through the train engine): rank 0 writes the model
    and reports; the training loss equals the one-process run's up to float summation order."""
    cfg = [*TINY, "sft.steps=4", "train.optimizer.warmup_steps=0"]
    single = run_cli(["sft", *cfg, f"output_dir={tmp_path / 'one'}"], tmp_path, check_rc=0)
    env = dict(os.environ, ASYNCRL_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "asyncrl.cli", "sft", *cfg, f"output_dir={tmp_path / 'two'}"],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("model_dir=") == 1 and "cached=False" in single.stdout  # rank 0
    assert "2 rank(s)" in proc.stderr
    one, two = (json.loads((tmp_path / d / "sft_result.json").read_text())
                for d in ("one", "two"))
    assert abs(one["final_loss"] - two["final_loss"]) < 1e-4 * max(1.0, one["final_loss"])
    assert (tmp_path / "two" / "config.json").is_file()


def test_missing_model_dir(tmp_path):
    proc = run_cli(["sft", f"model.path={tmp_path}/no_such_model"], tmp_path)
    assert_one_clean_error(proc, "no_such_model")


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft:\n  steps: [1, 2\n")
    assert_one_clean_error(run_cli(["sft", str(bad)], tmp_path), "bad.yaml", "malformed YAML")


def test_wrong_type_and_unknown_key(tmp_path):
    assert_one_clean_error(run_cli(["sft", "sft.steps=many"], tmp_path), "sft.steps='many'")
    assert_one_clean_error(run_cli(["sft", "sft.stpes=3"], tmp_path), "did you mean 'steps'")


def test_dataset_row_without_answer(tmp_path):
    data = tmp_path / "gsm.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n"
                    + json.dumps({"question": "2+2?"}) + "\n")
    proc = run_cli(["sft", *TINY_MODEL, "data.kind=gsm8k", f"data.path={data}"], tmp_path)
    assert_one_clean_error(proc, "gsm.jsonl:2", "answer")


@pytest.mark.parametrize("argv", [["--help"], ["sft", "--help"]])
def test_help(argv, tmp_path):
    assert "usage" in run_cli(argv, tmp_path, check_rc=0).stdout


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_local_servers_without_their_package_are_one_error_naming_server_python(tmp_path,
                                                                                 backend):
    """`inference.mode=local` with this python, which has neither vLLM nor SGLang: refused
    before any server starts, naming inference.server_python (not the server's traceback)."""
    from asyncrl.models.config import TinyModelConfig
    from asyncrl.models.tiny import build_tiny_model

    model = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2,
                                             num_kv_heads=1, intermediate_size=128),
                             tmp_path / "model")
    proc = run_cli(["train", "configs/train_tiny.yaml", f"model.path={model}",
                    "inference.mode=local", f"inference.backend={backend}", "total_steps=1",
                    f"output_dir={tmp_path / 'run'}"], tmp_path)
    assert_one_clean_error(proc, "inference.server_python=", f"no module named '{backend}'")


def test_a_warm_start_continues_its_base_trained_first(tmp_path, monkeypatch):
    """`base:` names the warm start this one continues: trained first when missing (then
    cached), keyed into this one's cache key; `base` and `model.path` together are refused."""
    from asyncrl.config import ConfigError
    from asyncrl.launch.sft import cache_key, run_sft_job
    from asyncrl.launch.sft_config import SFTRunConfig

    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    small = {"tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                      "intermediate_size": 64},
             "data": {"num_train": 16, "num_eval": 4},
             "sft": {"steps": 2, "batch_size": 4, "eval_size": 2, "eval_max_new_tokens": 3}}
    cfg = SFTRunConfig.from_dict({**small, "base": small, "sft": {**small["sft"], "steps": 1}})
    assert cache_key(cfg) != cache_key(cfg.model_copy(update={"base": None}))
    assert cache_key(cfg) != cache_key(SFTRunConfig.from_dict({**cfg.model_dump(
        exclude={"base"}), "base": {**small, "sft": {**small["sft"], "seed": 5}}}))
    result = run_sft_job(cfg)
    base_dir = tmp_path / "cache" / "sft" / f"tiny-sft-{cache_key(cfg.base)}"
    assert (base_dir / "sft_result.json").is_file() and not result.cached
    assert json.loads((Path(result.model_dir) / "sft_result.json").read_text())["steps"] == 1
    with pytest.raises(ConfigError, match="base and model.path"):
        SFTRunConfig.from_dict({"base": {}, "model": {"path": str(base_dir)}})
