"""The configuration of `asyncrl train`: every component's own config, nested.

With `model.path` unset the job warm-starts the embedded tiny model on the synthetic task
(`warm_start`, the same config and cache as `asyncrl sft`), which is the default main job. The
pluggable parts (`data`, `reward`, `workflow`, `actor.loss`, `inference.backend`, `launcher`) are
registered kinds (asyncrl/plugins.py); `plugins: [my_pkg.mod]` imports modules that register
kinds of their own before the rest of the config is read. Loading this config imports no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pydantic

from asyncrl.api import GenerationConfig
from asyncrl.config import Config
from asyncrl.data.arithmetic import ArithmeticTaskConfig
from asyncrl.data.dataset import DatasetConfig
from asyncrl.errors import UserError
from asyncrl.inference.backend_protocol import LoraServing
from asyncrl.inference.backends import BACKENDS, BackendConfig
from asyncrl.inference.config import EngineSettings, RemoteEngineConfig
from asyncrl.launch.launchers import LauncherConfig
from asyncrl.launch.run_logger import LoggingConfig
from asyncrl.launch.sft_config import SFTRunConfig
from asyncrl.launch.watchdog import WatchdogConfig
from asyncrl.launch.workflows import RLVRWorkflowConfig, WorkflowConfig
from asyncrl.models.config import DEFAULT_SHARD_SIZE, ModelConfig, parse_shard_size
from asyncrl.plugins import import_plugins
from asyncrl.reward.config import RewardConfig
from asyncrl.rollout.answer_eval import EvalConfig
from asyncrl.rollout.executor import RolloutConfig
from asyncrl.train.config import (CriticConfig, OptimizerConfig, PolicyTrainConfig,
                                  PPOActorConfig, lora_enabled)

CONFIG_FILE = "config.yaml"  # the resolved config of a run, in its directory
BROADCASTS = ("nccl", "gloo")


class InferenceLaunchConfig(Config):
    """Where rollouts are generated.

    - inprocess: the built-in engine on a thread of the trainer process (smallest runs; weights
      are handed over in memory, in-flight sequences continue under the new version).
    - local: `num_servers` servers of `backend`, started and stopped by the job (on this machine,
      or placed by the launcher: Ray); vLLM or SGLang run from `server_python`, the interpreter
      that has them.
    - remote: servers of `backend` someone else runs (`remote.addresses`).

    Weights reach servers as HTTP tensor buckets, a directory they load, or a collective
    broadcast over NCCL / gloo (the servers join a process group with the trainer): each backend
    declares which (`weight_syncs`), and `weight_sync: auto` picks HTTP buckets where the backend
    has them, else disk. Every server is checked before use (version range, routes, logprobs
    mode), must report each new version, and every `check_logprobs_every` updates every engine
    (in process too) generates on a small canary batch whose logprobs the trainer compares with
    its own (a wrong model, a failed reload or weights altered on the way show up there).
    """

    # where rollouts are generated (see above)
    mode: Literal["inprocess", "local", "remote"] = "inprocess"
    # the servers' kind, a registered backend (asyncrl, vllm, sglang): which ones to start
    # (local) or which ones run (remote)
    backend: BackendConfig = pydantic.Field("asyncrl", description="asyncrl | vllm | sglang")
    num_servers: int = pydantic.Field(1, ge=1)  # local
    server_python: str | None = None  # local vllm/sglang: its python (default: this one)
    server_args: list[str] = []  # local: extra command-line arguments for every server
    # The engines' own settings (inference/engine.py), for the in-process engine and the servers
    # this job starts (vLLM / SGLang take max_num_seqs, dtype and num_threads). num_threads: an
    # in-process engine's kernels (the trainer keeps torch_threads), a server's whole process.
    # trust_remote_code comes from model.trust_remote_code.
    engine: EngineSettings = EngineSettings(max_num_seqs=256, num_threads=1)
    startup_timeout_s: float = pydantic.Field(300.0, gt=0)  # local servers
    remote: RemoteEngineConfig | None = None  # mode remote: the servers' addresses
    # how weights reach the servers (see above); nccl between GPUs, gloo the same path over TCP
    weight_sync: Literal["auto", "tensors", "disk", "nccl", "gloo"] = "auto"
    # size of one HTTP / broadcast weight bucket
    bucket_bytes: int = pydantic.Field(64 << 20, ge=1 << 16)
    # nccl / gloo: the trainer's address the servers connect to (None: 127.0.0.1 for local
    # servers; for remote ones, this machine's address on the route to the first server) and
    # the rendezvous port (0: a free one)
    group_addr: str | None = None
    group_port: int = pydantic.Field(0, ge=0, le=65535)  # 0: a free port
    # weight pushes between logprob canaries; 0: never. None (auto): every push to servers (the
    # transfer can go wrong), every 20th in process (a canary there waits for the busy engine:
    # 0.35-0.40 s on the main job, against 0.6 s steps; the tensors are copied in memory)
    check_logprobs_every: int | None = pydantic.Field(None, ge=0)
    # mean |served - trainer| logprob over the probe's tokens: fp32 vLLM-CPU serving the default
    # model measured <= 2.6e-5; bf16 rounding is larger; a stale or wrong model is off by tenths
    check_logprobs_tolerance: float = pydantic.Field(0.05, gt=0)

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> InferenceLaunchConfig:
        kind, offered = self.backend.kind, self.backend.weight_syncs
        if self.mode == "remote" and self.remote is None:
            raise ValueError("inference.mode='remote' needs inference.remote.addresses "
                             "(e.g. [http://10.0.0.5:8000])")
        if self.mode == "inprocess" and kind != "asyncrl":
            raise ValueError(f"inference.backend={kind!r} needs inference.mode='local' (the job "
                             "starts the servers) or 'remote'; 'inprocess' runs the built-in "
                             "engine")
        if self.mode == "inprocess" and self.weight_sync in BROADCASTS:
            raise ValueError(f"inference.weight_sync={self.weight_sync!r} needs servers "
                             "(inference.mode 'local' or 'remote'); the in-process engine takes "
                             "the weights in memory (allowed: auto, tensors, disk)")
        if self.mode != "inprocess" and self.weight_sync not in ("auto", *offered):
            raise ValueError(f"inference.weight_sync={self.weight_sync!r} is not supported by "
                             f"backend {kind!r}; allowed: auto, {', '.join(offered)}")
        if self.engine.trust_remote_code:
            raise ValueError("inference.engine.trust_remote_code follows model.trust_remote_code;"
                             " set that one")
        return self

    @property
    def canary_every(self) -> int:
        """check_logprobs_every with auto resolved."""
        if self.check_logprobs_every is not None:
            return self.check_logprobs_every
        return 20 if self.mode == "inprocess" else 1

    @property
    def sync_kind(self) -> str:
        """'tensors', 'disk', 'nccl' or 'gloo', with auto resolved."""
        if self.weight_sync != "auto":
            return self.weight_sync
        return "tensors" if self.mode == "inprocess" or "tensors" in self.backend.weight_syncs \
            else "disk"

    def trusting(self, trust_remote_code: bool) -> InferenceLaunchConfig:
        """This config with `model.trust_remote_code` passed on to the engines: the in-process
        one and the servers the job starts (`--trust-remote-code`); remote servers are started
        by their owner, with their own flags."""
        if not trust_remote_code:
            return self
        engine = self.engine.model_copy(update={"trust_remote_code": True})
        return self.model_copy(update={"engine": engine})


def _default_generation() -> GenerationConfig:
    # room for a reasoning model's chain of thought; the tiny demo sets its own in its configs
    return GenerationConfig(n_samples=8, max_new_tokens=1024, temperature=1.0)


class TrainRunConfig(Config):
    """The configuration of a training run (`asyncrl train`, `Trainer`): model, warm start,
    data, reward, workflow, sampling, rollout, actor and its loss, trainer engine, critic,
    inference engines, evaluation, logging, watchdog, run length, checkpoints and launcher.

    `TrainRunConfig.load(path, overrides)` reads the YAML file at `path` (None: the defaults)
    and applies dotted `key.sub=value` overrides (values parsed as YAML), e.g.
    `TrainRunConfig.load("configs/train_tiny.yaml", ["train.optimizer.lr=1e-5"])`;
    `from_dict(data)` lays a dict over the defaults, so a section given in part keeps its
    other values. Modules listed in `plugins` are imported first, so the kinds they register
    can be named.

    Unknown keys (with a did-you-mean hint), out-of-range values and settings that contradict
    each other raise `ConfigError`, a ValueError whose message names the field, the bad value
    and what is allowed; a missing YAML file or a malformed override raises it too.
    """

    # modules imported before the rest is read: they register kinds of their own (a reward,
    # a backend, ...) that the sections below may name
    plugins: list[str] = []
    model: ModelConfig = ModelConfig()
    warm_start: SFTRunConfig = SFTRunConfig()  # used when model.path is None
    data: DatasetConfig = pydantic.Field(default_factory=ArithmeticTaskConfig)
    # a name (exact, digits, clevr_count_70k, math, code), package.module:function,
    # trl:package.module:function, or a mapping with a kind (judge, function, trl, code): asyncrl/reward/config.py
    reward: RewardConfig = pydantic.Field(
        "exact", description="exact | digits | clevr_count_70k | math | code | "
                             "package.module:function | "
                             "trl:package.module:function | {kind: judge, ...}")
    workflow: WorkflowConfig = pydantic.Field(default_factory=RLVRWorkflowConfig)
    gconfig: GenerationConfig = pydantic.Field(default_factory=_default_generation)
    # DAPO dynamic sampling: a group whose rewards are all equal has zero advantage everywhere;
    # dropping it keeps every trained token informative.
    filter_uniform_groups: bool = True
    rollout: RolloutConfig = RolloutConfig(batch_size=16, max_concurrent_rollouts=64,
                                           max_head_offpolicyness=2)
    actor: PPOActorConfig = PPOActorConfig()
    # the policy's engine; the LR schedule's horizon is total_steps * actor.ppo_n_minibatches and
    # its logprobs are taken at gconfig.temperature (the sampler's). The defaults suit a
    # pretrained model (GRPO recipes train at 1e-6: verl, TRL, DAPO) and compute in bf16 with
    # fp32 master weights where the device has it (train.autocast_dtype: auto)
    train: PolicyTrainConfig = PolicyTrainConfig(
        optimizer=OptimizerConfig(lr=1e-6, warmup_steps=10, schedule="constant"))
    # advantage.estimator gae: the critic, a value head on the policy's body trained alongside
    # (checkpointed with the run, sharded like the policy under torchrun)
    critic: CriticConfig = CriticConfig(
        optimizer=OptimizerConfig(lr=1e-5, warmup_steps=10, schedule="constant"))
    inference: InferenceLaunchConfig = InferenceLaunchConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    # stop a run that cannot make progress; time limits of the loop's waits
    watchdog: WatchdogConfig = WatchdogConfig()
    # policy updates (the run also stops at max_train_seconds)
    total_steps: int = pydantic.Field(1000, ge=1)
    max_train_seconds: float | None = pydantic.Field(
        None, gt=0, description="stop after this much training wall time (evals excluded); "
                                "None: no limit")
    checkpoint_every: int = pydantic.Field(50, ge=0)  # 0: only at the end
    # largest safetensors file of every HF directory the run writes (checkpoints' policy/, disk
    # weight syncs): bytes or "5GB"/"500MiB"; a bigger model is sharded with an index
    checkpoint_shard_size: int | str = DEFAULT_SHARD_SIZE
    output_dir: str | None = None  # None: runs/<UTC timestamp>
    seed: int = 0  # data order, sampling and initialisation
    torch_threads: int | None = pydantic.Field(
        None, ge=1, description="trainer; None: every core this process may use")
    # where the job runs: local (this machine; torchrun for several ranks) or ray (trainer ranks
    # and mode-local servers placed on a Ray cluster, `asyncrl train --ray ADDRESS`)
    launcher: LauncherConfig = pydantic.Field("local", description="local | ray | {kind: ray, ...}")

    @property
    def evaluation(self) -> EvalConfig:
        """`eval` with its max_new_tokens resolved: unset, it follows gconfig.max_new_tokens."""
        if self.eval.max_new_tokens is not None:
            return self.eval
        return self.eval.model_copy(update={"max_new_tokens": self.gconfig.max_new_tokens})

    @classmethod
    def shorthand(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The kinds `plugins` registers must exist before the sections naming them are read."""
        plugins = data.get("plugins", [])
        if isinstance(plugins, list) and all(isinstance(p, str) for p in plugins):
            import_plugins(plugins)
        return data

    @pydantic.field_validator("checkpoint_shard_size", mode="before")
    @classmethod
    def _shard_size(cls, value: Any) -> Any:  # before: pydantic would take `true` as 1 byte
        parse_shard_size(value, "checkpoint_shard_size")  # ValueError naming the allowed forms
        return value

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> TrainRunConfig:
        self._check_lora()
        self._check_images()
        self._check_routing_replay()
        if self.launcher.server_cpu_ids() and self.inference.mode != "local":
            raise ValueError(f"launcher.server_cpus places the servers of inference.mode='local';"
                             f" inference.mode={self.inference.mode!r} starts none")
        adv = self.actor.advantage
        if self.gconfig.n_samples < 2 and adv.estimator in (
                "grpo", "rloo", "drgrpo", "reinforce_pp_baseline") and not (
                adv.estimator == "grpo" and adv.singleton_group == "raw"):
            raise ValueError(f"gconfig.n_samples={self.gconfig.n_samples} is out of range for "
                             f"advantage.estimator={self.actor.advantage.estimator!r}: a group "
                             "baseline needs allowed [2, inf)")
        return self

    def _check_images(self) -> None:
        """A dataset whose rows carry images needs a vision-language model and the paths that
        carry images: the rlvr workflow or an agent (through the proxy), on the in-process
        engine or servers of a backend that takes images (vLLM)."""
        if not self.data.has_images:
            return
        kind = f"data.kind={self.data.kind!r} has images"
        if self.model.is_vision_language(self.warm_start.tiny) is False:
            what = ("the embedded tiny model, warm_start.tiny.arch="
                    f"{self.warm_start.tiny.arch!r}" if self.model.path is None
                    else self.model.path)
            raise ValueError(f"{kind}, but model.path ({what}) is a text-only model; set it to a "
                             "vision-language model (e.g. `asyncrl build-model OUT --preset "
                             "tiny-vl`), or warm_start.tiny.arch to 'qwen2_vl' or 'qwen3_vl'")
        if self.workflow.kind not in ("rlvr", "agent"):
            raise ValueError(f"{kind}: workflow.kind={self.workflow.kind!r} does not pass images "
                             "yet; allowed: rlvr, agent (image_url parts through the proxy)")
        backend = self.inference.backend
        if self.inference.mode != "inprocess" and not backend.images:
            allowed = [k for k in BACKENDS.kinds()
                       if BACKENDS.config_class(k).images]
            raise ValueError(f"{kind}: inference.backend={backend.kind!r} sends no images to its "
                             f"servers; allowed: {allowed} (or inference.mode=inprocess)")

    def _check_routing_replay(self) -> None:
        """Routing replay needs experts to route (told here for a local directory or the
        embedded model; a hub id is checked once resolved, at launch)."""
        for key, on in (("actor.moe.routing_replay", self.actor.moe.routing_replay),
                        ("inference.engine.record_routes", self.inference.engine.record_routes)):
            if on and self.model.is_mixture_of_experts(self.warm_start.tiny) is False:
                what = ("the embedded tiny model, warm_start.tiny.arch="
                        f"{self.warm_start.tiny.arch!r}" if self.model.path is None
                        else f"model.path={self.model.path}")
                raise ValueError(f"{key}=true needs a mixture-of-experts model; {what} is dense "
                                 "(set warm_start.tiny.arch='qwen3_moe', or a model.path whose "
                                 "config.json has experts: Qwen3-MoE, Mixtral)")

    def _check_lora(self) -> None:
        """`train.lora` pushes adapters: in memory, HTTP buckets or a PEFT directory, to servers
        whose backend takes them at run time (its declaration), never by broadcast."""
        if not lora_enabled(self.train.lora):
            return
        inf = self.inference
        if inf.sync_kind in BROADCASTS:
            raise ValueError(f"inference.weight_sync={inf.weight_sync!r} with train.lora is not "
                             "supported (the broadcast sends full weights); allowed: auto, "
                             "tensors, disk")
        if inf.mode == "inprocess":
            return
        backend = inf.backend
        if not backend.lora:
            able = [k for k in BACKENDS.kinds() if BACKENDS.config_class(k).lora]
            raise ValueError(f"train.lora with backend {backend.kind!r} is not supported; "
                             f"allowed backends: {', '.join(able)}")
        backend.check_lora(LoraServing(self.train.lora.r))


def load_run_config(run_dir: str | Path, overrides: list[str]) -> TrainRunConfig:
    """The saved config of a run (for --resume), with `overrides` applied on top."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"--resume {run_dir}: no {CONFIG_FILE} there; is it a run directory "
                        "written by asyncrl train?")
    return TrainRunConfig.load(str(path), overrides)
