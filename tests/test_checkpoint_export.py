"""The HF directories a training run writes (checkpoint `policy/`, disk weight syncs) are what
`save_pretrained` writes: generation_config.json, safetensors sharded by `checkpoint_shard_size`
with an index, tokenizer and chat template; transformers, the built-in engine and a real
`asyncrl serve` process load them and compute what the trainer computes.

One short real run (in-process engine, disk weight sync, a logprob canary after every push) with a
shard size small enough that the tiny model is written in several shards is shared by the tests.
"""

import json
from pathlib import Path

import httpx
import pytest
import torch
from conftest import TINY, running_servers
from safetensors.torch import load_file
from test_train_loop import small_config
from train_helpers import digit_reward
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl import Trainer
from asyncrl.config import ConfigError
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.launch.train_config import TrainRunConfig
from asyncrl.models.export import INDEX_FILE, save_weights_dir, untied_copy, weight_files
from asyncrl.models.config import parse_shard_size
from asyncrl.models.tiny import build_tiny_model_in_memory
from asyncrl.models.tokenizer import IM_END_ID
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.checkpoint import load_state

pytestmark = pytest.mark.usefixtures("one_thread")
SHARD = "100KB"  # the tiny test model (~300 KB of fp32 weights) is written in several shards
PROMPT = [1, 2, 45, 50, 55, 60, 3]
KEY = "export-test-key"


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    """Two steps, a checkpoint at each; weights reach the in-process engine as sharded
    directories, and the canary after every push stops the run if they did not load."""
    out = tmp_path_factory.mktemp("export") / "run"
    cfg = small_config(model_dir, out, total_steps=2, checkpoint_every=1,
                       checkpoint_shard_size=SHARD, **{"inference.weight_sync": "disk",
                                                       "inference.check_logprobs_every": 1})
    result = Trainer(cfg).train(reward=digit_reward)
    assert result.steps == 2 and result.stopped_by == "total_steps"
    return out


@pytest.fixture(scope="module")
def policy(run):
    return run / "checkpoints/step_000002/policy"


@pytest.fixture(scope="module")
def trainer_weights(run, model_dir):
    """The trainer's weights at step 2, from its own sharded state (DCP `trainer/`), loaded into
    the base model: independent of the exported policy/."""
    engine = HFTrainEngine.from_pretrained(model_dir, trainable=False)
    load_state(run / "checkpoints/step_000002/state", engine.parallel, {"trainer": engine})
    return engine.model


def test_policy_dir_is_a_save_pretrained_directory(policy, model_dir):
    names = {p.name for p in policy.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", INDEX_FILE} <= names
    # the base model's generation config travels: the engines stop at its eos ids
    base_gen = json.loads((Path(model_dir) / "generation_config.json").read_text())
    gen = json.loads((policy / "generation_config.json").read_text())
    assert gen["eos_token_id"] == base_gen["eos_token_id"] == IM_END_ID
    # transformers 4.x readers' spellings stay next to 5.x's
    config = json.loads((policy / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "float32" and "rope_theta" in config
    tokenizer = AutoTokenizer.from_pretrained(policy)
    assert tokenizer.chat_template and tokenizer.eos_token_id == IM_END_ID


def test_policy_dir_is_sharded_with_an_index(policy):
    index = json.loads((policy / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (policy / "model.safetensors").exists()
    assert sorted(p.name for p in policy.glob("*.safetensors")) == shards
    limit = parse_shard_size(SHARD)
    assert all((policy / s).stat().st_size <= limit + 1024 for s in shards)  # + json header
    # the disk syncs of the same run were written the same way
    assert (policy.parents[2] / "weights/v2" / INDEX_FILE).is_file()


def test_transformers_loads_the_trainers_weights(policy, trainer_weights, model_dir):
    exported = AutoModelForCausalLM.from_pretrained(policy)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ours, trained, before = (m(ids).logits for m in (exported, trainer_weights, base))
    assert torch.equal(ours, trained)
    assert not torch.allclose(ours, before)  # the run moved the weights: not the base model


def _transformers_greedy(model, prompt, n):
    """Greedy tokens and their logprobs, one full forward per token (no cache)."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            token = int(logp.argmax())
            ids.append(token)
            logprobs.append(float(logp[token]))
            if token == IM_END_ID:
                break
    return ids[len(prompt):], logprobs


def test_builtin_engine_loads_the_sharded_dir(policy, trainer_weights):
    engine = LLMEngine(EngineConfig(model_path=str(policy), max_seq_len=64, max_num_seqs=1))
    assert engine.sampler.eos_token_ids == [IM_END_ID]  # from generation_config.json
    from asyncrl.api import GenerationConfig, ModelRequest

    req = ModelRequest(input_ids=PROMPT, gconfig=GenerationConfig(greedy=True, max_new_tokens=8))
    out = engine.generate([req])[0]
    tokens, logprobs = _transformers_greedy(trainer_weights, PROMPT, 8)
    assert out.output_tokens == tokens
    assert max(abs(a - b) for a, b in zip(out.output_logprobs, logprobs)) < 1e-3


def test_asyncrl_serve_serves_the_sharded_checkpoint(policy, trainer_weights):
    with running_servers(policy, 1, "--api-key", KEY, "engine.max_seq_len=64",
                         "engine.max_num_seqs=4") as [(url, _)]:
        out = httpx.post(url + "/generate", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                         json={"input_ids": PROMPT, "max_new_tokens": 8, "greedy": True}).json()
    tokens, logprobs = _transformers_greedy(trainer_weights, PROMPT, 8)
    assert out["output_tokens"] == tokens
    assert max(abs(a - b) for a, b in zip(out["output_logprobs"], logprobs)) < 1e-3


def test_generation_config_is_derived_from_the_tokenizer_when_the_base_has_none(tmp_path):
    model, tokenizer = build_tiny_model_in_memory(TINY)
    config = model.config
    config.eos_token_id = config.bos_token_id = config.pad_token_id = None
    out = save_weights_dir(model.state_dict(), config, tmp_path / "m", tokenizer)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.eos_token_id == IM_END_ID
    assert gen["pad_token_id"] == tokenizer.pad_token_id
    engine = LLMEngine(EngineConfig(model_path=str(out), max_seq_len=32, max_num_seqs=1))
    assert engine.sampler.eos_token_ids == [IM_END_ID]


def test_tied_head_gathered_as_a_separate_copy_is_written_once(tmp_path):
    """Under FSDP the gathered state dict holds lm_head.weight as its own copy of the tied
    embeddings: the file still holds the weight once, and transformers re-ties it."""
    model, tokenizer = build_tiny_model_in_memory(TINY)
    gathered = {name: t.clone() for name, t in model.state_dict().items()}
    assert "lm_head.weight" in gathered
    out = save_weights_dir(gathered, model.config, tmp_path / "m", tokenizer)
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(out)(ids).logits,
                           model(ids).logits)


def test_untied_copy_of_a_sharded_dir_keeps_the_generation_config(policy, tmp_path):
    """The vLLM path: a tied model is served with its own output head."""
    copy = untied_copy(policy, tmp_path / "served", max_shard_size=SHARD)
    assert json.loads((copy / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" in json.loads((copy / INDEX_FILE).read_text())["weight_map"]
    assert ((copy / "generation_config.json").read_text()
            == (policy / "generation_config.json").read_text())
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        a, b = (AutoModelForCausalLM.from_pretrained(d)(ids).logits for d in (policy, copy))
    assert torch.equal(a, b)


def test_weight_files_follow_the_index_and_ignore_other_safetensors(policy, tmp_path):
    """An adapter next to the weights (adapter_model.safetensors) is not read as the model's."""
    assert [p.name for p in weight_files(policy)] == sorted(
        set(json.loads((policy / INDEX_FILE).read_text())["weight_map"].values()))
    model, tokenizer = build_tiny_model_in_memory(TINY)
    out = save_weights_dir(model.state_dict(), model.config, tmp_path / "one", tokenizer)
    (out / "adapter_model.safetensors").write_bytes(b"not weights")
    assert [p.name for p in weight_files(out)] == ["model.safetensors"]
    LLMEngine(EngineConfig(model_path=str(out), max_seq_len=32, max_num_seqs=1))  # loads
    shard = sorted(policy.glob("model-*.safetensors"))[0]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / INDEX_FILE).write_text((policy / INDEX_FILE).read_text())
    with pytest.raises(ValueError, match=shard.name):
        weight_files(broken)


@pytest.mark.parametrize(("value", "size"), [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20),
                                             (123456, 123456), ("2.5 kb", 2500)])
def test_shard_size_forms(value, size):
    assert parse_shard_size(value) == size
    assert TrainRunConfig.from_dict({"checkpoint_shard_size": value}).checkpoint_shard_size == value


@pytest.mark.parametrize("value", ["5 gigs", 0, -3, True, 2.5, "GB"])
def test_bad_shard_size_is_one_line_naming_the_field(value):
    with pytest.raises(ConfigError) as err:
        TrainRunConfig.from_dict({"checkpoint_shard_size": value})
    message = str(err.value)
    assert "checkpoint_shard_size" in message and repr(value) in message and "'5GB'" in message
    assert "\n" not in message
