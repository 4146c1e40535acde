"""The remote client's end of collective weight sync (`inference.weight_sync: nccl | gloo`).

The trainer process is rank 0 of a process group whose other ranks are the servers' engines
(as many per server as it has workers: vLLM says so on a route, SGLang's tensor-parallel size is
`ranks_per_server`; `asyncrl serve` takes 1).
The group is formed on the first update, and formed again whenever the set of reachable servers
changes or an update fails, since a collective cannot skip a member: a server that was down
rejoins with the next update and so gets the current weights back. Forming it = open the
rendezvous store (a free port unless one is configured), send every server its join call, and
build the trainer's end, all at once, because each side blocks until everyone has joined.

One update = every server's update call (which returns once its engine serves the version) sent
while the trainer broadcasts; the backend says in which layout (`Backend.broadcast_layout`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from asyncrl.api import WeightUpdateMeta
from asyncrl.inference.backend_protocol import Backend, GroupJoin, HttpCall, WireTensor
from asyncrl.inference.routing import ServerState
from asyncrl.inference.weight_group import DistributedWeightSender, spec_of

log = logging.getLogger(__name__)

Request = Callable[[ServerState, HttpCall, float], Awaitable[Any]]
Apply = Callable[[ServerState, list[HttpCall], int], Awaitable[None]]


class GroupSync:
    def __init__(self, backend: Backend, request: Request, apply: Apply,
                 ranks_per_server: int, timeout_s: float, probe_timeout_s: float) -> None:
        if backend.broadcast_layout is None:
            raise ValueError(f"kind=distributed is not supported by backend={backend.name!r}; "
                             "allowed: disk (and tensors for asyncrl)")
        self.backend, self._request, self._apply = backend, request, apply
        self.ranks_per_server = ranks_per_server
        self.timeout_s, self.probe_timeout_s = timeout_s, probe_timeout_s
        self.sender: Any = None  # DistributedWeightSender, or VLLMWeightSender for vLLM
        self.members: list[ServerState] = []
        self.addresses: list[str] = []  # the members' addresses when the group formed
        self.joins: list[GroupJoin] = []  # each member's place in the group
        self.groups_formed = 0

    async def update(self, servers: list[ServerState], meta: WeightUpdateMeta,
                     weights: Mapping[str, Any] | None) -> dict[ServerState, BaseException | None]:
        """Every reachable server receives `meta.version`; the result per server is None or its
        error (an unreachable server: the error of its health call)."""
        if weights is None:
            raise ValueError("update_weights(kind=distributed) needs the `weights` argument")
        results = await self._attempt(servers, meta, weights)
        missed = [s for s, r in results.items() if r is not None]
        if not missed:
            return results
        # A member that died mid-broadcast fails everyone's stream: once more, with a group of
        # the servers reachable now (the ones that got it already get the same weights again).
        log.warning("weight update to version %d failed on %d of %d server(s) (%s); forming the "
                    "group again and retrying once", meta.version, len(missed), len(servers),
                    str(results[missed[0]])[:200])
        retry = await self._attempt(servers, meta, weights)
        return {s: None if results[s] is None else retry[s] for s in servers}

    async def _attempt(self, servers: list[ServerState], meta: WeightUpdateMeta,
                       weights: Mapping[str, Any]) -> dict[ServerState, BaseException | None]:
        reachable = await self._reachable(servers)
        results = dict(reachable)
        members = [s for s in servers if reachable[s] is None]
        if not members:
            return results
        try:
            if (self.sender is None or members != self.members
                    or [s.address for s in members] != self.addresses
                    or spec_of(weights) != self.sender.spec):
                await self._form(members, meta, weights)
            results.update(await self._broadcast(meta, weights))
        except Exception as err:
            self.close()
            results.update({s: err for s in members})
        return results

    async def _reachable(self, servers: list[ServerState]) -> dict[ServerState, Any]:
        async def probe(server: ServerState) -> BaseException | None:
            try:
                await self._request(server, self.backend.health_call(), self.probe_timeout_s)
            except Exception as err:
                return err
            return None

        errors = await asyncio.gather(*(probe(s) for s in servers))
        return dict(zip(servers, errors))

    async def _form(self, members: list[ServerState], meta: WeightUpdateMeta,
                    weights: Mapping[str, Any]) -> None:
        self.close()
        ranks = await self._ranks(members)
        offsets = [1 + sum(ranks[:i]) for i in range(len(members))]
        # a name per group: a process keeps a group's name registered until it is destroyed
        meta = dataclasses.replace(meta, world_size=1 + sum(ranks),
                                   group_name=f"{meta.group_name}_{self.groups_formed + 1}")
        sender = await asyncio.to_thread(self._sender_class(), meta, weights, self.timeout_s,
                                         False)
        joins = [GroupJoin(meta.master_addr, sender.port, meta.world_size, offset,
                           meta.group_name, meta.backend) for offset in offsets]
        calls = [self._request(s, self.backend.join_group_call(j), self.timeout_s)
                 for s, j in zip(members, joins)]
        outcome = await asyncio.gather(asyncio.to_thread(sender.connect), *calls,
                                       return_exceptions=True)
        failed = [(s.address if s else "trainer", r) for s, r in zip([None, *members], outcome)
                  if isinstance(r, BaseException)]
        if failed:
            sender.close()
            raise RuntimeError("forming the weight group failed: "
                               + "; ".join(f"{who}: {err}" for who, err in failed))
        self.sender, self.members, self.joins = sender, members, joins
        self.addresses = [s.address for s in members]
        self.groups_formed += 1
        log.info("weight group %d formed at %s:%d (%s, world size %d: the trainer and %d "
                 "server(s))", self.groups_formed, meta.master_addr, sender.port, meta.backend,
                 meta.world_size, len(members))

    async def _broadcast(self, meta: WeightUpdateMeta, weights: Mapping[str, Any]
                         ) -> dict[ServerState, BaseException | None]:
        sender = self.sender
        wire = [WireTensor(n, tuple(shape), dt) for n, shape, dt in sender.wire_tensors()]
        calls = [self.backend.distributed_update_calls(j, wire, meta.version)
                 for j in self.joins]
        sent, *applied = await asyncio.gather(
            asyncio.to_thread(sender.broadcast, weights, meta.version,
                              self.backend.broadcast_layout),
            *(self._apply(s, c, meta.version) for s, c in zip(self.members, calls)),
            return_exceptions=True)
        results = {s: r if isinstance(r, BaseException) else None
                   for s, r in zip(self.members, applied)}
        if isinstance(sent, BaseException) or any(r is not None for r in results.values()):
            await self._recover(self.members)
            self.close()  # the stream is out of step: the next update forms a new group
        if isinstance(sent, BaseException):
            return {s: r or sent for s, r in results.items()}
        return results

    async def _ranks(self, members: list[ServerState]) -> list[int]:
        """Group ranks per server: asked of servers that tell (vLLM: its TP*PP*DP workers),
        else `ranks_per_server`."""
        call = self.backend.ranks_call()
        if call is None:
            return [self.ranks_per_server] * len(members)
        replies = await asyncio.gather(*(self._request(s, call, self.probe_timeout_s)
                                         for s in members))
        return [self.backend.parse_ranks(r) for r in replies]

    def _sender_class(self) -> type:
        if self.backend.broadcast_layout == "vllm_per_tensor":  # vLLM's own communicator
            from asyncrl.inference.vllm_weight_transfer import VLLMWeightSender

            return VLLMWeightSender
        return DistributedWeightSender

    async def _recover(self, servers: list[ServerState]) -> None:
        """Best effort: servers left mid-update go back to their old weights (vLLM would
        otherwise hold its layers on the meta device and die at the next generation)."""
        calls = self.backend.failed_update_recovery_calls()

        async def one(server: ServerState) -> None:
            for call in calls:
                try:
                    await self._request(server, call, self.probe_timeout_s)
                except Exception as err:  # noqa: BLE001 (recorded: the update already failed)
                    log.warning("recovering %s after a failed weight update: %s: %s",
                                server.address, call.path, err)
                    return

        if calls:
            await asyncio.gather(*(one(s) for s in servers))

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.sender, self.members, self.joins, self.addresses = None, [], [], []
