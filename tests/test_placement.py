"""CPU placement of the local launcher: the trainer and its local servers on CPUs of their own
(as generation and training would sit on separate GPUs). Real processes; Linux affinity."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.errors import UserError
from asyncrl.launch.launchers import LocalLauncher
from asyncrl.launch.train_config import TrainRunConfig

CPUS = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs this process may use")


@pytest.mark.parametrize("cpus", [[], [0, 0], [10_000], [-1]])
def test_cpu_ids_that_cannot_be_used_are_refused_with_the_allowed_ones(cpus):
    with pytest.raises(ConfigError, match=r"launcher.trainer_cpus=.*allowed: \["):
        TrainRunConfig.from_dict({"launcher": {"kind": "local", "trainer_cpus": cpus}})


def test_server_cpus_need_servers_of_mode_local():
    with pytest.raises(ConfigError, match="server_cpus.*inference.mode='inprocess' starts none"):
        TrainRunConfig.from_dict({"launcher": {"kind": "local", "server_cpus": [CPUS[0]]}})
    cfg = TrainRunConfig.from_dict({"launcher": {"kind": "local", "server_cpus": [CPUS[0]]},
                                    "inference": {"mode": "local"}})
    assert cfg.launcher.server_cpus == [CPUS[0]]


def test_trainer_cpus_under_torchrun_are_refused(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(UserError, match="torchrun"):
        LocalLauncher(trainer_cpus=[CPUS[0]]).run(None, lambda job: None)


def test_pinning_moves_every_thread_of_the_process():
    """torch's thread pool exists before the pin (a matmul ran): it is moved too."""
    script = textwrap.dedent(f"""
        import os, torch
        from asyncrl.launch.launchers import pin_process
        torch.set_num_threads(2)
        torch.ones(512, 512) @ torch.ones(512, 512)
        pin_process([{CPUS[-1]}])
        print(sorted({{c for t in os.listdir('/proc/self/task')
                      for c in os.sched_getaffinity(int(t))}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == str([CPUS[-1]])


@two_cpus
@pytest.mark.slow
def test_a_job_runs_with_its_trainer_and_server_on_cpus_of_their_own(model_dir, tmp_path):
    """`asyncrl train` with trainer_cpus / server_cpus: the trainer and its server each report
    the CPUs they run on, and the run logs the rollout idle share of every step."""
    trainer_cpu, server_cpu = CPUS[-1], CPUS[0]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", f"model.path={model_dir}",
           f"output_dir={run}", "total_steps=3", "max_train_seconds=null", "eval.every=0",
           "gconfig.n_samples=4", "gconfig.max_new_tokens=6", "rollout.batch_size=4",
           "filter_uniform_groups=false", "logging.tensorboard=false", "inference.mode=local",
           f"launcher.trainer_cpus=[{trainer_cpu}]", f"launcher.server_cpus=[{server_cpu}]",
           "reward=train_helpers:digit_reward"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
    job = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert job.returncode == 0, job.stderr[-2000:]
    assert f"trainer: 1 torch threads on CPUs [{trainer_cpu}]" in job.stderr
    server_log = (run / "logs/server_0.log").read_text()
    assert f"asyncrl serve: 1 torch threads on CPUs [{server_cpu}]" in server_log
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    idle = [r["perf/rollout_idle_frac"] for r in rows if "reward/mean" in r]
    assert len(idle) == 3 and all(0.0 <= x <= 1.0 for x in idle)
