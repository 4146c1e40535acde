"""Models by HF conventions: `model.path` as a hub id resolved from the local HF cache (built
here in huggingface_hub's layout, models--org--name/snapshots/<commit> + refs/main, read with
HF_HUB_OFFLINE=1), and `trust_remote_code` honoured by every loader, through the real entry
points (loaders, train/critic engines, the built-in engine, `asyncrl serve`, SFT, eval and a
`Trainer` run). The custom-code model is the tiny Qwen2 model renamed to a model type transformers
does not ship (`myqwen`), whose config and model classes live in the directory's own .py files
(auto_map). No hub is reachable here, so only the cached/offline path is exercised, not the
download."""

import json
import shutil

import httpx
import pytest
from conftest import running_servers
from test_hf_datasets import write_snapshot
from test_train_loop import small_config

from asyncrl import Trainer
from asyncrl.cli import main
from asyncrl.config import ConfigError
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.inference.config import EngineSettings
from train_helpers import server_command
from asyncrl.models.hub import looks_local
from asyncrl.models.loading import ModelLoadError, load_causal_lm, load_tokenizer, resolve_model_dir
from asyncrl.models.config import ModelConfig
from asyncrl.train.critic import load_critic
from asyncrl.train.parallel import SingleProcess
from asyncrl.train.config import CriticConfig
from asyncrl.train.engine import HFTrainEngine

pytestmark = pytest.mark.usefixtures("one_thread")

MAIN, OLD = "c" * 40, "d" * 40
NEEDS_TRUST = "needs the directory's own code .* set model.trust_remote_code=true"

CONFIG_PY = """from transformers import Qwen2Config


class MyQwenConfig(Qwen2Config):
    model_type = "myqwen"
"""
MODELING_PY = """from transformers import Qwen2ForCausalLM

from .configuration_myqwen import MyQwenConfig


class MyQwenForCausalLM(Qwen2ForCausalLM):
    config_class = MyQwenConfig
"""


def make_custom_code_model(src, out):
    """`src` (a Qwen2 model dir) as model_type `myqwen`, defined only by out/*.py."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="myqwen", architectures=["MyQwenForCausalLM"], auto_map={
        "AutoConfig": "configuration_myqwen.MyQwenConfig",
        "AutoModelForCausalLM": "modeling_myqwen.MyQwenForCausalLM"})
    (out / "config.json").write_text(json.dumps(config))
    (out / "configuration_myqwen.py").write_text(CONFIG_PY)
    (out / "modeling_myqwen.py").write_text(MODELING_PY)
    return out


@pytest.fixture(scope="module")
def custom_dir(model_dir, tmp_path_factory):
    return make_custom_code_model(model_dir, tmp_path_factory.mktemp("custom") / "myqwen")


@pytest.fixture
def hub(tmp_path, monkeypatch, model_dir, custom_dir):
    """A HF hub cache holding org/tiny (at MAIN and OLD), org/custom and the dataset
    org/sums; HF_HUB_OFFLINE=1 and HF_HUB_CACHE point at it."""
    cache = tmp_path / "hub"
    for name, src, commits in (("tiny", model_dir, (MAIN, OLD)), ("custom", custom_dir, (MAIN,))):
        repo = cache / f"models--org--{name}"
        for commit in commits:
            shutil.copytree(src, repo / "snapshots" / commit)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(MAIN)
    (cache / "models--org--tiny" / "snapshots" / OLD / "old-marker").write_text("")
    data = cache / "datasets--org--sums"
    write_snapshot(data / "snapshots" / MAIN, {
        "main/train-00000-of-00001.parquet": [(f"{i}+{i}", str(2 * i)) for i in range(8)],
        "main/test-00000-of-00001.parquet": [("1+2", "3"), ("2+2", "4")],
        "socratic/train-00000-of-00001.parquet": [("1+1", "2")],
    })
    (data / "refs").mkdir()
    (data / "refs" / "main").write_text(MAIN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_what_counts_as_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for local in ("/abs/model", "./model", "../model", "~/model", "runs/missing", "a/b/c",
                  "has space/x"):
        assert looks_local(local), local
    for hub_id in ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "org/name.v2"):
        assert not looks_local(hub_id), hub_id


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(hub):
    snap = resolve_model_dir(ModelConfig(path="org/tiny"))
    assert snap == hub / "models--org--tiny" / "snapshots" / MAIN
    old = resolve_model_dir(ModelConfig(path="org/tiny", revision=OLD))
    assert (old / "old-marker").is_file()
    assert load_tokenizer(snap).encode("1+1") and load_causal_lm(snap).config.vocab_size > 0


def test_errors_for_hub_ids_not_cached_and_for_local_paths(hub, tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError) as err:
        resolve_model_dir(ModelConfig(path="org/never-downloaded"))
    msg = str(err.value)
    assert "\n" not in msg and "model.path=org/never-downloaded" in msg
    assert str(hub) in msg and "HF_HUB_OFFLINE" in msg and "download it once" in msg
    with pytest.raises(ModelLoadError, match=f"org/tiny@nope: revision not in the HF cache .*; "
                                             f"cached: main, {MAIN}, {OLD}"):
        resolve_model_dir(ModelConfig(path="org/tiny", revision="nope"))
    # paths stay paths: the usual "not found" naming them, no hub lookup
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for local in ("./nope", "runs/step_1/policy", str(tmp_path / "nope")):
        with pytest.raises(ModelLoadError, match=r"model dir .*not found; expected a local HF "
                                                 r"model directory .* or a hub id"):
            resolve_model_dir(ModelConfig(path=local))
    with pytest.raises(ConfigError, match="revision='v1' applies to a hub id"):
        ModelConfig.from_dict({"path": "./local", "revision": "v1"}, "model")


def test_every_loader_honours_trust_remote_code(custom_dir, tmp_path):
    for load in (lambda trust: load_causal_lm(custom_dir, trust_remote_code=trust),
                 lambda trust: load_tokenizer(custom_dir, trust),
                 lambda trust: HFTrainEngine.from_pretrained(custom_dir, trust_remote_code=trust),
                 lambda trust: load_critic(custom_dir, CriticConfig(), "float32", 10, SingleProcess(), trust),
                 lambda trust: LLMEngine(EngineConfig(model_path=str(custom_dir),
                                                      max_num_seqs=2, trust_remote_code=trust))):
        with pytest.raises(ModelLoadError, match=NEEDS_TRUST):
            load(False)
        assert load(True) is not None
    model = load_causal_lm(custom_dir, trust_remote_code=True)
    assert type(model).__name__ == "MyQwenForCausalLM"
    assert type(model).__module__.startswith("transformers_modules.")  # the directory's code
    engine = LLMEngine(EngineConfig(model_path=str(custom_dir), max_num_seqs=2,
                                    trust_remote_code=True))
    assert type(engine.runner).__name__ == "HFModelRunner"  # the custom arch's fallback path
    assert type(engine.runner.model).__name__ == "MyQwenForCausalLM"


def test_servers_the_job_starts_are_told_to_trust_remote_code():
    trusting = EngineSettings(trust_remote_code=True)
    for backend in ("vllm", "sglang"):
        assert "--trust-remote-code" in server_command(backend, "/m", engine=trusting).argv
        assert "--trust-remote-code" not in server_command(backend, "/m").argv
    assert "engine.trust_remote_code=true" in server_command("asyncrl", "/m",
                                                             engine=trusting).argv


def test_asyncrl_serve_takes_a_hub_id_and_trust_remote_code(hub, capsys):
    with running_servers("org/custom", 1, "--trust-remote-code") as [(url, _)]:
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": "default", "prompt": "1+1=", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    # refusals happen before the server would listen: the CLI in process is enough
    assert main(["serve", "--model", "org/custom", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the directory's own code (configuration_myqwen.py, " \
        "modeling_myqwen.py); set model.trust_remote_code=true (--trust-remote-code" in err
    assert main(["serve", "--model", "org/nothing", "--port", "0"]) == 2
    assert "--model=org/nothing: model not found in the HF cache" in capsys.readouterr().err


def test_trainer_runs_a_hub_id_custom_code_model_on_a_hub_dataset(hub, tmp_path):
    """The real training path: trainer, reference model and in-process engine all load the
    resolved snapshot with the model's own code; the data comes from the cached dataset."""
    cfg = small_config("org/custom", tmp_path / "run", **{
        "model.trust_remote_code": True, "total_steps": 1, "eval.every": 0,
        "actor.ppo.kl_coef": 0.01,  # a reference model is loaded too
        "data": {"kind": "hf", "name": "org/sums", "config": "main", "eval_split": "test",
                 "answer_field": "reward_model.ground_truth", "system_prompt": "Add."}})
    result = Trainer(cfg).train()
    assert result.steps == 1 and result.stopped_by == "total_steps"
    saved = tmp_path / "run" / "config.yaml"
    assert "org/custom" in saved.read_text()  # the run records the id the user gave
    # the checkpoint carries the model's code, so it loads (eval, resume) like the base did
    policy = tmp_path / "run" / "checkpoints" / "step_000001" / "policy"
    assert (policy / "modeling_myqwen.py").is_file()
    assert type(load_causal_lm(policy, trust_remote_code=True)).__name__ == "MyQwenForCausalLM"
    with pytest.raises(ModelLoadError, match=NEEDS_TRUST):
        Trainer(small_config("org/custom", tmp_path / "refused", **{"total_steps": 1})).train()


def test_sft_and_eval_take_hub_ids_with_trust_remote_code(hub, tmp_path):
    from asyncrl.launch.evaluate import run_eval_job
    from asyncrl.launch.sft import run_sft_job
    from asyncrl.launch.sft_config import SFTRunConfig
    from asyncrl.rollout.answer_eval import EvalConfig

    cfg = SFTRunConfig.from_dict({
        "model": {"path": "org/custom", "trust_remote_code": True},
        "data": {"kind": "hf", "name": "org/sums", "config": "main", "eval_split": "test",
                 "answer_field": "reward_model.ground_truth"},
        "sft": {"steps": 2, "batch_size": 4, "eval_size": 2, "eval_max_new_tokens": 2},
        "output_dir": str(tmp_path / "sft")})
    result = run_sft_job(cfg)
    assert result.steps == 2 and result.eval_size == 2
    data = tmp_path / "eval.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+3", "answer": "5"}\n')
    evaluated = run_eval_job("org/custom", str(data), EvalConfig(max_new_tokens=2),
                             trust_remote_code=True)
    assert evaluated.num_problems == 2
    with pytest.raises(ModelLoadError, match=NEEDS_TRUST):
        run_eval_job("org/custom", str(data), EvalConfig(max_new_tokens=2))
