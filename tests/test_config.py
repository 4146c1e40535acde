"""Typed config: YAML load, dotted overrides, validation messages, dump/reload identity."""

from typing import Literal

import pydantic
import pytest

from asyncrl.api import GenerationConfig
from asyncrl.config import Config, ConfigError


class OptimizerCfg(Config):
    lr: float = pydantic.Field(1e-3, gt=0, le=1)
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: Literal["constant", "cosine"] = "cosine"


class ActorCfg(Config):
    optimizer: OptimizerCfg = OptimizerCfg()
    gconfig: GenerationConfig = GenerationConfig()
    micro_batch_tokens: int = pydantic.Field(4096, ge=1)


class RunCfg(Config):
    actor: ActorCfg = ActorCfg()
    name: str = "run"
    eval_every: int | None = None


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_yaml_and_dotted_overrides(tmp_path):
    p = write(tmp_path, "name: exp\nactor:\n  optimizer:\n    lr: 0.01\n")
    cfg = RunCfg.load(p, ["actor.optimizer.lr=3e-4", "actor.gconfig.top_p=0.9", "eval_every=5"])
    assert cfg.name == "exp"
    assert cfg.actor.optimizer.lr == pytest.approx(3e-4)
    assert cfg.actor.gconfig.top_p == 0.9
    assert cfg.eval_every == 5
    assert cfg.actor.optimizer.schedule == "cosine"  # untouched default


def test_dump_and_reload_is_identical(tmp_path):
    cfg = RunCfg.load(None, ['actor.gconfig.stop=["\\n", "END"]', "actor.optimizer.schedule=constant"])
    cfg.save(tmp_path / "resolved.yaml")
    again = RunCfg.load(tmp_path / "resolved.yaml")
    assert again == cfg
    assert again.to_yaml() == cfg.to_yaml()
    assert again.actor.gconfig.stop == ["\n", "END"]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("actor.optimizer.lrr=1", "unknown key 'actor.optimizer.lrr'; did you mean 'lr'?"),
        ("actr.optimizer.lr=1", "unknown key 'actr'; did you mean 'actor'?"),
        ("actor.gconfig.topp=0.5", "did you mean 'top_p'?"),
        ("actor.optimizer.lr=-1", "actor.optimizer.lr=-1: Input should be greater than 0"),
        ("actor.optimizer.lr=2", "actor.optimizer.lr=2: Input should be less than or equal to 1"),
        ("actor.optimizer.lr=fast", "actor.optimizer.lr='fast': Input should be a valid number"),
        ("actor.optimizer.schedule=linear", "schedule='linear': Input should be 'constant' or 'cosine'"),
        ("actor.gconfig.top_p=2", "top_p=2.0 is out of range; allowed (0.0, 1.0]"),
        ("actor.micro_batch_tokens=0", "micro_batch_tokens=0: Input should be greater than or equal to 1"),
        ("actor.optimizer=3", "actor.optimizer=3"),
    ],
)
def test_bad_values_name_the_field_and_allowed_range(override, expected):
    with pytest.raises(ConfigError) as err:
        RunCfg.load(None, [override])
    assert expected in str(err.value)
    assert "\n" not in str(err.value)  # one line per problem


def test_all_errors_reported_at_once():
    with pytest.raises(ConfigError) as err:
        RunCfg.load(None, ["name=1", "actor.optimizer.lr=-1", "bogus=1"])
    lines = str(err.value).splitlines()
    assert len(lines) == 2  # name=1 is coerced to "1" (a CLI number for a str field is fine)
    assert any("lr=-1" in ln for ln in lines) and any("bogus" in ln for ln in lines)


def test_malformed_yaml_and_missing_file(tmp_path):
    p = write(tmp_path, "actor:\n  optimizer: [1, 2\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: line \d+, column \d+: malformed YAML"):
        RunCfg.load(p)
    with pytest.raises(ConfigError, match="config file not found"):
        RunCfg.load(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        RunCfg.load(write(tmp_path, "- 1\n- 2\n", "list.yaml"))


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="key.sub=value"):
        RunCfg.load(None, ["actor.optimizer.lr"])
    with pytest.raises(ConfigError, match="is a value"):
        RunCfg.load(None, ["name=x", "name.sub=1"])


def test_validate_assignment():
    cfg = RunCfg()
    with pytest.raises(pydantic.ValidationError):
        cfg.actor.optimizer.lr = -5


class CatCfg(Config):
    kind: Literal["cat"] = "cat"
    lives: int = 9


class DogCfg(Config):
    kind: Literal["dog"] = "dog"
    bark: str = "woof"


class ZooCfg(Config):
    animal: CatCfg | DogCfg = pydantic.Field(default_factory=CatCfg, discriminator="kind")


def test_tagged_union_errors_use_the_users_path_and_hint():
    assert ZooCfg.load(None, ["animal.kind=dog", "animal.bark=arf"]).animal.bark == "arf"
    with pytest.raises(ConfigError) as err:
        ZooCfg.load(None, ["animal.kind=dog", "animal.brak=arf"])
    assert "unknown key 'animal.brak'; did you mean 'bark'?" in str(err.value)


def test_partial_nested_override_keeps_the_preset_values():
    from asyncrl.launch.train_config import TrainRunConfig

    preset = TrainRunConfig()
    cfg = TrainRunConfig.load(None, ["train.optimizer.lr=1e-5", "rollout.batch_size=4"])
    assert cfg.train.optimizer.lr == 1e-5
    assert cfg.train.optimizer.warmup_steps == preset.train.optimizer.warmup_steps == 10
    assert cfg.rollout.max_head_offpolicyness == preset.rollout.max_head_offpolicyness == 2
    # switching a tagged union member takes that member's own defaults, not the old member's keys
    cfg = TrainRunConfig.load(None, ["data.kind=gsm8k", "data.path=x.jsonl"])
    assert cfg.data.kind == "gsm8k" and cfg.data.path == "x.jsonl"
