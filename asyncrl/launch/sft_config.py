"""The configuration of `asyncrl sft` and of `asyncrl train`'s warm start (`warm_start:`)."""

from __future__ import annotations

import pydantic

from asyncrl.config import Config
from asyncrl.data.arithmetic import ArithmeticTaskConfig
from asyncrl.data.dataset import DatasetConfig
from asyncrl.models.config import ModelConfig, TinyModelConfig
from asyncrl.train.config import OptimizerConfig, SFTConfig, TrainEngineConfig


class SFTRunConfig(Config):
    """The configuration of a supervised fine-tuning run: `asyncrl sft`, and the warm start
    `asyncrl train` runs first when `model.path` is unset (its `warm_start` section). Sets the
    model to start from (a path, the embedded tiny model, or a `base` warm start to continue),
    the data, the training engine, the SFT steps and the output directory.

    `SFTRunConfig.load(path, overrides)` reads the YAML file at `path` (None: the defaults) and
    applies dotted `key.sub=value` overrides (values parsed as YAML); `from_dict(data)` lays a
    dict over the defaults. Unknown keys (with a did-you-mean hint), out-of-range values and
    contradicting settings (both `base` and `model.path`) raise `ConfigError`, a ValueError
    whose message names the field.
    """

    model: ModelConfig = ModelConfig()
    tiny: TinyModelConfig = TinyModelConfig()  # used when model.path is None
    data: DatasetConfig = pydantic.Field(default_factory=ArithmeticTaskConfig)
    # the engine the steps run on (micro-batching, precision, optimizer; FSDP2 under torchrun);
    # its LR schedule's horizon is sft.steps. One micro-batch holds a whole default batch.
    train: TrainEngineConfig = TrainEngineConfig(
        max_tokens_per_mb=4096,
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=20, schedule="cosine", min_lr_ratio=0.1))
    # The embedded preset: long enough to learn most of 2-digit addition, but from
    # demonstrations where 60% of answers are off by one, so the model starts RL knowing the
    # arithmetic and often answering with the wrong habit (configs/sft_tiny.yaml; the result
    # ships in asyncrl/warm_starts/ with its accuracy).
    sft: SFTConfig = SFTConfig(steps=600, label_noise=0.6)
    output_dir: str | None = None  # None: a cache directory keyed by this config
    # the warm start this one continues (taken from the cache, or trained first); model.path
    # must then be unset. E.g. `base: {}`: the main job's warm start.
    base: SFTRunConfig | None = None

    @pydantic.model_validator(mode="after")
    def _one_starting_point(self) -> SFTRunConfig:
        if self.base is not None and self.model.path is not None:
            raise ValueError(f"base and model.path ({self.model.path!r}) both name the model to "
                             "start from; allowed: one of them")
        return self

    @pydantic.model_validator(mode="after")
    def _images_need_a_vision_model(self) -> SFTRunConfig:
        if self.data.has_images and self.model.is_vision_language(self.tiny) is False:
            what = (f"the embedded tiny model, tiny.arch={self.tiny.arch!r}"
                    if self.model.path is None else self.model.path)
            raise ValueError(f"data.kind={self.data.kind!r} has images, but model.path ({what}) "
                             "is a text-only model; set tiny.arch to 'qwen2_vl' or 'qwen3_vl', "
                             "or model.path to a vision-language model")
        return self
