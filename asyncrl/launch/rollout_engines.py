"""The rollout side of a training job: which engine generates, and how new weights reach it.

`open_rollout_engines(cfg, model_dir, log_dir, launcher)` yields `RolloutEngines`: `.engine` (the
ServingEngine the executor drives) and `.push(weights, version)` (a coroutine run on the
executor's event loop), the job's one way to deliver weights: every engine takes them through
`update_weights(meta, weights)`. `.version` is the version every engine serves: the push advances
it once all of them have the new weights, and the executor follows it (its staleness bound counts
served versions; the trainer's own version runs ahead during a push). In process, the update is
applied between two engine steps and sequences in flight continue under the new weights. Over
HTTP the client pauses the servers (requests in flight come back partial and are continued after
the update, so one sequence may hold tokens of two versions), streams the weights in buckets or
has the servers load a directory, checks that each server reports the new version, and resumes.
With a `LogprobCheck` (`inference.check_logprobs_every`: every push to servers, every 20th in
process by default), every engine's logprobs on a small canary batch are then compared with the
trainer's.

With an `AdapterSpec` (train.lora) a push carries the LoRA adapter only (PEFT names; in memory,
HTTP buckets, or an adapter directory for `/update_weights/lora` or vLLM's LoRA routes) and each
engine merges it into the base model it was started from.

Servers of mode local are started where the launcher places them, with the command their
backend writes (`BackendKind.server_command`); a backend that needs an untied output head
(vLLM) is given an untied copy. Servers are checked before the first rollout (`check_servers`).
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import socket
import sys
from dataclasses import dataclass, replace
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from asyncrl.api import PolicyVersion, ServingEngine, WeightUpdateKind, WeightUpdateMeta
from asyncrl.inference.backend_protocol import (BackendKind, LoraServing, ServerCommand,
                                              ServerLaunch)
from asyncrl.inference.config import RemoteEngineConfig
from asyncrl.launch.launchers import Launcher
from asyncrl.launch.train_config import InferenceLaunchConfig
from asyncrl.launch.weight_check import LogprobCheck
from asyncrl.models.config import DEFAULT_SHARD_SIZE, is_vision_language



@dataclass(frozen=True)
class AdapterSpec:
    """How the job's LoRA adapter is described to the engines."""

    scale: float  # alpha / r
    peft_config: dict[str, Any]  # adapter_config.json of a disk push
    keep_versions: int  # adapter versions a server keeps for requests in flight (eta + 1)


class RolloutEngines:
    def __init__(self, engine: ServingEngine, cfg: InferenceLaunchConfig, *, remote: bool,
                 model_dir: Path, weights_dir: Path, urls: list[str] | None = None,
                 untie: bool = False, version: int = 0,
                 shard_size: int | str = DEFAULT_SHARD_SIZE, check: LogprobCheck | None = None,
                 adapter: AdapterSpec | None = None) -> None:
        """`model_dir`: the model the engines started from. `check`: the logprob canary run
        after pushes (every `cfg.canary_every`). `adapter`: with train.lora, pushes carry the
        adapter only."""
        self.engine, self.cfg, self.remote = engine, cfg, remote
        # disk sync: each version a HF directory of safetensors files of at most `shard_size`,
        # with the starting model's config, generation config and tokenizer
        self.model_dir, self.shard_size = Path(model_dir), shard_size
        self.version = PolicyVersion(version)  # served by every engine; only `push` moves it
        self.weights_dir, self.urls = weights_dir, urls or []
        self.untie = untie  # disk updates write an output head of their own
        self.check, self.adapter = check, adapter
        self._updates = 0
        self.group_addr = cfg.group_addr or _route_addr(self.urls)  # nccl / gloo sync

    async def push(self, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Every engine serves `version` when this returns. Returns what was sent
        (`weight_sync/*`) and the logprob check's metrics when one ran. With `adapter` set,
        `weights` is a LoRA adapter (PEFT names) and only it travels."""
        sent: Mapping[str, torch.Tensor] | None = weights
        if self.adapter is not None:
            meta, sent = self._adapter_meta(weights, version)
        elif self.cfg.sync_kind == "disk":
            from asyncrl.models.export import save_weights_dir

            hf_config, tokenizer, generation = self._model_files()
            path = save_weights_dir(weights, hf_config, self.weights_dir / f"v{version}",
                                    tokenizer, untie=self.untie, generation_config=generation,
                                    max_shard_size=self.shard_size)
            _remove_older(self.weights_dir, version)
            meta, sent = WeightUpdateMeta.from_disk(str(path), version), None
        elif self.cfg.sync_kind in ("nccl", "gloo"):
            meta = WeightUpdateMeta(
                kind=WeightUpdateKind.DISTRIBUTED, version=version,
                master_addr=self.group_addr, master_port=self.cfg.group_port,
                world_size=1 + len(self.urls), backend=self.cfg.sync_kind,
                bucket_bytes=self.cfg.bucket_bytes)
        else:
            meta = WeightUpdateMeta.from_tensors(version, self.cfg.bucket_bytes)
        if not self.remote:
            await self.engine.update_weights(meta, sent)
        else:
            self.engine.pause()
            try:
                await self.engine.update_weights(meta, sent)
            finally:
                self.engine.resume()
        self.version.set(version)
        self._updates += 1
        metrics = {"weight_sync/tensors": float(len(weights)),
                   "weight_sync/bytes": float(sum(t.numel() * t.element_size()
                                                  for t in weights.values()))}
        every = self.cfg.canary_every
        if self.check is not None and every and self._updates % every == 0:
            metrics.update(await self.check.run(self.engine, version))
        return metrics

    @functools.cache  # noqa: B019 (one per engines object, which lives as long as the run)
    def _model_files(self) -> tuple[Any, Any, Any]:
        """The starting model's config, tokenizer and generation config (None: derived from
        the config when written), which every disk push writes beside the weights."""
        from transformers import AutoConfig, GenerationConfig

        from asyncrl.models.loading import load_tokenizer

        trust = self.cfg.engine.trust_remote_code
        config = AutoConfig.from_pretrained(self.model_dir, local_files_only=True,
                                            trust_remote_code=trust)
        generation = None
        if (self.model_dir / "generation_config.json").is_file():
            generation = GenerationConfig.from_pretrained(self.model_dir, local_files_only=True)
        return config, load_tokenizer(self.model_dir, trust), generation

    def _adapter_meta(self, adapter: Mapping[str, torch.Tensor], version: int
                      ) -> tuple[WeightUpdateMeta, Mapping[str, torch.Tensor] | None]:
        """A LoRA push: the adapter in memory / HTTP buckets, or a PEFT adapter directory."""
        spec = self.adapter
        if self.cfg.sync_kind == "disk":
            from asyncrl.models.lora import write_adapter_dir

            path = write_adapter_dir(adapter, spec.peft_config, self.weights_dir / f"v{version}")
            _remove_older(self.weights_dir, version - spec.keep_versions + 1)
            return WeightUpdateMeta.lora_from_disk(str(path), version, spec.keep_versions), None
        if self.cfg.sync_kind != "tensors":
            raise ValueError(f"inference.weight_sync={self.cfg.sync_kind!r} with train.lora; "
                             "allowed: tensors, disk")
        return WeightUpdateMeta.lora_from_tensors(version, spec.scale, self.cfg.bucket_bytes,
                                                  spec.keep_versions), adapter

    def interrupt(self) -> None:
        """Every generation in flight returns now with its partial output, new ones return
        empty, until `resume` (for a checkpoint of the episodes in flight; both engines)."""
        self.engine.interrupt()

    def resume(self) -> None:
        self.engine.resume()

    async def check_servers(self) -> None:
        """Before the first rollout: each server's own checks (version range, routes,
        logprobs mode, a model of the trainer's shape); nothing for the in-process engine."""
        await self.engine.check_servers(str(self.model_dir))

    async def canary(self, version: int) -> dict[str, float]:
        """The logprob canary now, unless the run has none."""
        if self.check is None or not self.cfg.canary_every:
            return {}
        return await self.check.run(self.engine, version)


def _route_addr(urls: list[str]) -> str:
    """This machine's address on the route to the first server (what it can connect back to);
    a UDP connect sends nothing."""
    host = urlsplit(urls[0]).hostname if urls else None
    if not host or host in ("localhost", "127.0.0.1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _remove_older(weights_dir: Path, version: int) -> None:
    """Disk sync keeps the newest two weight directories (one may still be loading); a LoRA
    push keeps the adapters a server may still hold for requests in flight."""
    for old in weights_dir.glob("v*"):
        if old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def open_rollout_engines(cfg: InferenceLaunchConfig, model_dir: str | Path, log_dir: Path,
                         launcher: Launcher, detokenize: Any = None,
                         shard_size: int | str = DEFAULT_SHARD_SIZE,
                         lora: LoraServing | None = None, check: LogprobCheck | None = None,
                         adapter: AdapterSpec | None = None) -> Iterator[RolloutEngines]:
    """The engines of `cfg`, serving the model in `model_dir` at version 0. `launcher`: where
    servers of mode local run. `shard_size`: of the safetensors files written for the engines
    (disk sync, untied copy). `lora`: pushes will be LoRA adapters; servers of mode local are
    started to take them, remote ones are checked for it."""
    weights_dir = log_dir.parent / "weights"  # disk sync only; created on first use
    common = {"model_dir": Path(model_dir), "shard_size": shard_size, "check": check,
              "adapter": adapter}
    if cfg.sync_kind == "nccl" and not torch.cuda.is_available():
        raise ValueError("inference.weight_sync='nccl' needs CUDA in the trainer process and "
                         "this one has none; allowed here: gloo (the same broadcast over TCP), "
                         "tensors (asyncrl servers), disk")
    if cfg.mode == "inprocess":
        from asyncrl.inference.async_engine import AsyncLLMEngine
        from asyncrl.inference.engine import EngineConfig, LLMEngine

        engine = AsyncLLMEngine(LLMEngine(EngineConfig.of(model_dir, cfg.engine), detokenize))
        try:
            yield RolloutEngines(engine, cfg, remote=False, weights_dir=weights_dir, **common)
        finally:
            engine.shutdown()
        return

    from asyncrl.inference.remote import RemoteInferenceEngine

    backend = cfg.backend
    with contextlib.ExitStack() as stack:
        servers = None
        if cfg.mode == "local":
            served = str(Path(model_dir).resolve())  # a server may run on another node
            if backend.untied_head:
                from asyncrl.models.export import untied_copy

                served = str(untied_copy(model_dir, log_dir.parent / "served_model",
                                         shard_size, cfg.engine.trust_remote_code))
            launch = ServerLaunch(python=cfg.server_python or sys.executable, engine=cfg.engine,
                                  extra_args=tuple(cfg.server_args),
                                  weight_transfer=cfg.sync_kind == "nccl", lora=lora)
            servers = stack.enter_context(launcher.servers(
                partial(_command, backend, served, launch), cfg.num_servers, log_dir,
                cfg.startup_timeout_s))
            remote_cfg = RemoteEngineConfig(addresses=servers.urls, api_key=servers.api_key)
        else:
            remote_cfg = cfg.remote
        # lora: a backend that takes adapters checks its servers' settings at startup
        # images: passed to the backends that send them (their declaration)
        images = {"images": is_vision_language(model_dir)} if backend.images else {}
        engine = RemoteInferenceEngine(remote_cfg, backend.build(model=remote_cfg.model,
                                                                 lora=lora, **images))
        stack.callback(engine.close)
        if servers is not None:
            stack.enter_context(servers.watching(engine))
        yield RolloutEngines(engine, cfg, remote=True, weights_dir=weights_dir,
                             urls=list(remote_cfg.addresses), untie=backend.untied_head,
                             **common)


def _command(backend: BackendKind, model_dir: str, launch: ServerLaunch, api_key: str,
             host: str) -> ServerCommand:
    """One server's command (picklable: a Ray actor on another node calls it)."""
    return backend.server_command(model_dir, replace(launch, api_key=api_key, host=host))
