"""Shared fixtures: a tiny local model and real `asyncrl serve` processes on 127.0.0.1."""

import contextlib
import os
import random
import subprocess
import sys
import time

import pytest
import torch

from asyncrl.api.trajectory import Sample
from asyncrl.launch.serve import READY_PREFIX
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig

def pytest_collection_modifyitems(config, items):
    """`gpu` tests run only where CUDA is; elsewhere each is skipped saying so."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marker gpu); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                       intermediate_size=128, seed=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(TINY, tmp_path_factory.mktemp("model") / "tiny")


@contextlib.contextmanager
def running_servers(model_dir, count, *args):
    """`count` servers started together (each spends seconds importing torch); yields
    [(url, process)] and stops them (SIGTERM, then SIGKILL after 20 s) afterwards."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "asyncrl.cli", "serve", "--model", str(model_dir), "--port",
           "0", *args]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(count)]
    try:
        urls = []
        for proc in procs:
            line = proc.stdout.readline()
            if not line.startswith(READY_PREFIX):
                pytest.fail(f"server did not start: {line!r} {proc.stderr.read()[-3000:]}")
            urls.append(line[len(READY_PREFIX):].strip())
        yield list(zip(urls, procs))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                pytest.fail("server did not exit within 20 s of SIGTERM")


def make_samples(lengths, seed=0, vocab=60):
    """Random prompt + completion samples of the given total lengths (a third is prompt)."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        p = max(1, n // 3)
        out.append(Sample.from_prompt_and_completion(
            [rng.randrange(3, vocab) for _ in range(p)],
            [rng.randrange(3, vocab) for _ in range(n - p)],
            [-1.0] * (n - p), [0] * (n - p)))
    return out


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and OpenMP barriers stall badly when the
    2 cores are shared (CI, a neighbouring process): run the module on one thread, then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SERVE_KEY = "serve-key"  # the api key of the `serve_url` server


@pytest.fixture(scope="module")
def serve_url(model_dir, one_thread):
    """A real `asyncrl serve` app (uvicorn on 127.0.0.1) on the tiny model, keyed SERVE_KEY."""
    from tests.http_helpers import inference_server

    with inference_server(model_dir, f"api_key={SERVE_KEY}") as url:
        yield url


@pytest.fixture(scope="module")
def proxy(model_dir, one_thread):
    """A real agent proxy (uvicorn on 127.0.0.1) in front of the tiny model's engine."""
    from tests.http_helpers import proxy_server

    with proxy_server(model_dir) as p:
        yield p


def run_episodes(executor, rows, timeout=120.0):
    """Every row once through `executor` (whose staleness budget must admit them all); the
    accepted trajectories, oldest first. A test helper: training consumes `prepare_batch`."""
    before = executor.stats()
    finished = lambda s: s["accepted"] + s["rejected"] + s["failed"]  # noqa: E731
    for row in rows:
        executor.submit(row)
    deadline = time.monotonic() + timeout
    while finished(executor.stats()) - finished(before) < len(rows):
        if time.monotonic() > deadline:
            pytest.fail(f"{len(rows)} episodes not finished in {timeout}s: {executor.stats()}")
        time.sleep(0.01)
    return executor.wait(executor.stats()["accepted"] - before["accepted"])
