"""Bad input stops a job before step 1, in one line naming the setting: a reward whose signature
cannot take the call, a reward or plugin module Python cannot find (saying where it looked and
how to add a directory), a tokenizer that does not give back the chat template's text, a data
kind without its file; and the run's own messages name the user's settings, not internal classes.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from test_train_loop import small_config
from tokenizer_helpers import word_level_tokenizer

from asyncrl import Trainer
from asyncrl.config import ConfigError
from asyncrl.errors import UserError
from asyncrl.launch.train_config import TrainRunConfig
from asyncrl.models.tokenizer import build_byte_tokenizer
from asyncrl.models.tokenizer_check import TokenizerMismatchError, check_chat_round_trip


def one_arg(completion):
    return 1.0


def no_steps_ran(run_dir) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return not metrics.exists() or not any(
        "reward/mean" in json.loads(line) for line in metrics.read_text().splitlines())


def test_a_reward_object_that_cannot_take_the_call_is_refused_at_once(model_dir, tmp_path):
    with pytest.raises(UserError, match=r"Trainer.train\(reward=...\): one_arg\(completion\) "
                                        r"cannot be called as reward\(completion, row\).*"
                                        r"def one_arg\(completion, row\) -> float"):
        Trainer(small_config(model_dir, tmp_path / "run")).train(reward=one_arg)
    assert not (tmp_path / "run").exists()  # nothing loaded, nothing written


def test_a_reward_path_that_cannot_take_the_call_stops_before_step_1(model_dir, tmp_path,
                                                                      monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def score(completion):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"reward=my_rewards:score: score\(completion\) cannot "
                                        r"be called as reward\(completion, row\)"):
        Trainer(small_config(model_dir, run, reward="my_rewards:score")).train()
    assert no_steps_ran(run)


def test_a_reward_module_python_cannot_find_says_where_it_looked(model_dir, tmp_path,
                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    with pytest.raises(UserError) as err:
        Trainer(small_config(model_dir, run, reward="nowhere_rewards:score")).train()
    message = str(err.value)
    assert message.startswith("reward 'nowhere_rewards:score': no module 'nowhere_rewards'")
    assert f"working directory ({tmp_path})" in message and "PYTHONPATH" in message
    assert "\n" not in message
    assert no_steps_ran(run)


def test_a_plugin_module_python_cannot_find_fails_when_the_config_loads():
    with pytest.raises(UserError, match=r"plugins: 'nowhere_plugins': no module "
                                        r"'nowhere_plugins'.*PYTHONPATH"):
        TrainRunConfig.from_dict({"plugins": ["nowhere_plugins"]})


def test_a_data_file_kind_without_its_path_names_the_command_line():
    with pytest.raises(ConfigError, match=r"^the command line: data: missing required key "
                                          r"'path'"):
        TrainRunConfig.load(None, ["data.kind=jsonl"])


def spaceless_tokenizer():
    """A tokenizer whose vocabulary has no space or newline: they become <|unk|>."""
    return word_level_tokenizer(chr(c) for c in range(33, 127))


def test_a_tokenizer_that_loses_the_templates_text_is_refused():
    messages = [{"role": "user", "content": "What is 64 + 65?"}]
    check_chat_round_trip(build_byte_tokenizer(), messages, {}, "tiny")  # the good one passes
    with pytest.raises(TokenizerMismatchError, match=r"model X: the tokenizer \(\w+\) does not "
                                                     r"give back the chat template's text.*came "
                                                     r"back as '<\|im_start\|>user<\|unk\|>"):
        check_chat_round_trip(spaceless_tokenizer(), messages, {}, "model X")


def test_the_job_checks_the_rendered_prompt_before_step_1(model_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bad / f).unlink()
    spaceless_tokenizer().save_pretrained(bad)
    run = tmp_path / "run"
    with pytest.raises(TokenizerMismatchError, match=r"does not give back the chat template"):
        Trainer(small_config(bad, run)).train(reward=lambda completion, row: 0.0)
    assert no_steps_ran(run)


def test_training_with_shared_prefixes_warns_nothing(model_dir):
    """transformers 5.2x deprecates the KV cache's old keyword with a FutureWarning per call."""
    from asyncrl.api.trajectory import Sample
    from asyncrl.train.config import TrainEngineConfig
    from asyncrl.train.engine import HFTrainEngine

    engine = HFTrainEngine.from_pretrained(model_dir, TrainEngineConfig(device="cpu"),
                                           trainable=False)
    prompt = [2, 91, 89, 75, 88, 5, 28, 26, 3, 5]
    samples = [Sample.from_prompt_and_completion(prompt, [28 + i, 3], [-1.0, -1.0], [0, 0])
               for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = engine.forward(samples)
    assert len(out) == 4 and all(torch.isfinite(x).all() for x in out)


def test_a_generation_limit_the_context_cannot_hold_stops_before_step_1(model_dir, tmp_path):
    """The tiny model's context is 1024 tokens: the real-model default of 1024 new tokens after
    a prompt does not fit, and the engines never truncate."""
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"^gconfig.max_new_tokens=1024: the first prompt \(\d+ "
                                        r"tokens\) \+ 1024 = \d+ exceeds the context of 1024 "
                                        r"tokens.*lower gconfig.max_new_tokens$"):
        Trainer(small_config(model_dir, run, **{"gconfig.max_new_tokens": 1024})).train(
            reward=lambda completion, row: 0.0)
    assert no_steps_ran(run)
