"""How new weights reach every server the remote client drives (`RemoteInferenceEngine.
update_weights`): DISK (each server loads a directory by path), TENSORS (HTTP buckets,
weight_buckets.py) or DISTRIBUTED (a broadcast over the trainer's weight group,
remote_group.py); then each server must report the new version on its health route.

Per server: a success sets its version; a connection failure marks it missed (out of rotation
until a probe finds it at the current version; the next update is sent to it too); any other
error fails the update. No server reached fails it too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

from asyncrl.api import WeightUpdateKind, WeightUpdateMeta
from asyncrl.inference.backend_protocol import Backend, HttpCall
from asyncrl.inference.config import RemoteEngineConfig
from asyncrl.inference.remote_errors import RemoteEngineError, ServerFailure
from asyncrl.inference.remote_group import GroupSync
from asyncrl.inference.routing import ServerPool, ServerState

Request = Callable[[ServerState, HttpCall, float], Awaitable[Any]]


class RemoteWeights:
    def __init__(self, cfg: RemoteEngineConfig, backend: Backend, pool: ServerPool,
                 request: Request) -> None:
        self.cfg, self.backend, self.pool, self._request = cfg, backend, pool, request
        self._group: GroupSync | None = None  # collective weight sync, formed on first use

    async def update(self, meta: WeightUpdateMeta, weights: Mapping[str, Any] | None) -> None:
        if meta.kind == WeightUpdateKind.DISTRIBUTED:
            outcome = await self._group_sync().update(self.pool.servers, meta, weights)
        else:
            jobs = self._weight_jobs(meta, weights)
            outcome = dict(zip(jobs, await asyncio.gather(*jobs.values(),
                                                           return_exceptions=True)))
        errors, updated = [], 0
        for server, result in outcome.items():
            if result is None or not isinstance(result, BaseException):
                # it answered the update and its check at this version: (back) in rotation
                self.pool.probe_result(server, True, meta.version)
                updated += 1
            elif isinstance(result, (ServerFailure, httpx.TransportError)):
                self.pool.mark_failed(server, f"missed weight update to version {meta.version}: "
                                              f"{result}")
            else:
                errors.append(f"{server.address}: {result}")
        if errors:
            raise RuntimeError(f"weight update to version {meta.version} failed: "
                               + "; ".join(errors))
        if updated == 0:
            raise RemoteEngineError(f"weight update to version {meta.version} reached no server; "
                                    f"servers: {self.pool.describe()}")

    def _weight_jobs(self, meta: WeightUpdateMeta, weights: Mapping[str, Any] | None
                     ) -> dict[ServerState, Any]:
        servers = self.pool.servers
        if meta.kind == WeightUpdateKind.DISK and meta.lora:  # a PEFT adapter directory
            calls = self.backend.lora_update_calls(meta.path, meta.version, meta.keep_versions)
            return {s: self._update_and_verify(s, calls, meta.version) for s in servers}
        if meta.kind == WeightUpdateKind.DISK:
            calls = self.backend.disk_update_calls(meta.path, meta.version)
            if not calls:
                raise ValueError(f"kind=disk is not supported by backend={self.backend.name!r}: "
                                 "its server has no endpoint that loads weights from a path")
            return {s: self._update_and_verify(s, calls, meta.version) for s in servers}
        if meta.kind == WeightUpdateKind.TENSORS:
            if not self.backend.supports_tensor_push:
                raise ValueError(f"kind=tensors is not supported by backend={self.backend.name!r}; "
                                 f"allowed: {WeightUpdateKind.DISK.value}")
            if weights is None:
                raise ValueError("update_weights(kind=tensors) needs the `weights` argument")
            from asyncrl.inference.weight_buckets import push_weights_over_http

            items = list(weights.items())

            async def push(server: ServerState) -> None:
                await asyncio.to_thread(push_weights_over_http, server.address, items,
                                        meta.version, meta.bucket_bytes, self.cfg.api_key,
                                        self.cfg.control_timeout_s,
                                        meta.lora_scale if meta.lora else None)
                await self._verify_version(server, meta.version)

            return {s: push(s) for s in servers}
        raise ValueError(f"kind={meta.kind.value!r} is not supported by the remote client; "
                         f"allowed {[k.value for k in WeightUpdateKind]}")

    def _group_sync(self) -> GroupSync:
        if self._group is None:
            self._group = GroupSync(self.backend, self._request, self._update_and_verify,
                                    self.cfg.ranks_per_server, self.cfg.control_timeout_s,
                                    self.cfg.connect_timeout_s)
        return self._group

    async def _update_and_verify(self, server: ServerState, calls: list[HttpCall],
                                 version: int) -> None:
        for call in calls:
            body = await self._request(server, call, self.cfg.control_timeout_s)
            if isinstance(body, dict) and body.get("success") is False:  # SGLang-style failure
                raise RuntimeError(f"{call.path} failed: {str(body)[:300]}")
        await self._verify_version(server, version)

    async def _verify_version(self, server: ServerState, version: int) -> None:
        """The server itself must now report `version` (when its health route reports one)."""
        body = await self._request(server, self.backend.health_call(), self.cfg.control_timeout_s)
        reported = self.backend.parse_health(body)
        if reported is not None and reported != version:
            raise RuntimeError(f"after the update to version {version} the server reports "
                               f"version {reported} on {self.backend.health_call().path}")

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
