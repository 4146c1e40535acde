"""Rollout servers placed by Ray (`launcher: ray` with `inference.mode: local`).

Each server is a Ray actor (CPUs, GPUs and custom resources from `launcher.*_per_server`) that
starts
one server process (`asyncrl serve`, vLLM or SGLang, the same command lines as on one machine)
listening on its node's address, and dies with it: the process is started with the kernel told
to end it with its parent, so killing the actor (a lost node) leaves no orphan. Ray starts a
dead actor again (`launcher.max_server_restarts`); the new server has a new address.

`RayServers` is a `ServerFleet` (launch/launchers.py) like `LocalServers`; its `watching(engine)`
is a thread on the trainer's rank 0 that asks each actor for its address every
`launcher.server_poll_s` and hands a changed one to `RemoteInferenceEngine.replace_server`, so a
restarted server serves again once the next weight update has reached it. What ran where goes
to RUN/ray_placement.json (`record_placement`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.launch.local_servers import LocalServers, new_api_key

if TYPE_CHECKING:
    from asyncrl.launch.launchers import MakeCommand, RayLauncherConfig

log = logging.getLogger(__name__)

PLACEMENT_FILE = "ray_placement.json"


def record_placement(run_dir: Path, role: str, nodes: list[dict[str, Any]]) -> None:
    """RUN/ray_placement.json[role] = nodes (what ran where, for the user and the tests)."""
    path = Path(run_dir) / PLACEMENT_FILE
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[role] = nodes
    # whole or not at all: a reader (the user's tools, the tests) never sees it half-written
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def node_address() -> str:
    """This node's address as the cluster knows it (`ray start --node-ip-address`), which
    `ray.util.get_node_ip_address()` (a routing guess) may not be."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    for n in ray.nodes():
        if n["NodeID"] == node:
            return n["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


class ServerActor:
    """One server process on this actor's node (Ray runs `__init__` again after a restart)."""

    def __init__(self, make_command: MakeCommand, index: int, log_dir: str,
                 startup_timeout_s: float, api_key: str) -> None:
        import ray

        host = node_address()
        self.node = ray.get_runtime_context().get_node_id()
        self.server = LocalServers(lambda key: make_command(key, host), 1,
                                   Path(log_dir) / f"server_{index}", startup_timeout_s,
                                   api_key=api_key).start()

    def url(self) -> str:
        return self.server.urls[0]

    def where(self) -> tuple[str, str]:
        """(address, Ray node id)."""
        return self.server.urls[0], self.node

    def pid(self) -> int:
        return os.getpid()


class RayServers:
    def __init__(self, make_command: MakeCommand, count: int, log_dir: str | Path,
                 startup_timeout_s: float, ray_cfg: RayLauncherConfig) -> None:
        self.make_command, self.count = make_command, count
        self.log_dir = Path(log_dir).resolve()  # the actors' working directory is not ours
        self.timeout, self.cfg = startup_timeout_s, ray_cfg
        self.api_key = new_api_key()
        self.actors: list[Any] = []
        self.urls: list[str] = []
        self.nodes: list[str] = []

    def __enter__(self) -> RayServers:
        import ray

        cfg = self.cfg
        resources = cfg.server_bundle()
        actor = ray.remote(ServerActor).options(
            num_cpus=resources.pop("CPU"), num_gpus=resources.pop("GPU", 0),
            resources=resources or None, max_restarts=cfg.max_server_restarts)
        try:
            self.actors = [actor.remote(self.make_command, i, str(self.log_dir), self.timeout,
                                        self.api_key) for i in range(self.count)]
            places = ray.get([a.where.remote() for a in self.actors],
                             timeout=self.timeout + 60)
        except BaseException:
            self._kill()
            raise
        self.urls = [u for u, _ in places]
        self.nodes = [n for _, n in places]
        print("rollout servers placed by Ray: " + ", ".join(
            f"{u} (node {n[:8]})" for u, n in places), file=sys.stderr, flush=True)
        self._record()
        return self

    def _record(self) -> None:
        record_placement(self.log_dir.parent, "servers", [
            {"url": u, "node": n} for u, n in zip(self.urls, self.nodes)])

    def __exit__(self, *exc: object) -> None:
        self._kill()

    def _kill(self) -> None:
        import ray

        for a in self.actors:
            with contextlib.suppress(Exception):  # already dead: nothing to stop
                ray.kill(a, no_restart=True)
        self.actors = []

    @contextlib.contextmanager
    def watching(self, engine: Any) -> Iterator[None]:
        """While inside: restarted servers' new addresses reach `engine.replace_server`."""
        stop = threading.Event()
        thread = threading.Thread(target=self._watch, args=(engine, stop), daemon=True,
                                  name="ray-server-watch")
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=10)

    def _watch(self, engine: Any, stop: threading.Event) -> None:
        import ray

        while not stop.wait(self.cfg.server_poll_s):
            for i, actor in enumerate(self.actors):
                try:
                    url, node = ray.get(actor.where.remote(), timeout=self.cfg.server_poll_s)
                except Exception as err:  # noqa: BLE001 (dead or restarting: asked again later)
                    log.debug("server actor %d not answering: %s", i, err)
                    continue
                if url != self.urls[i]:
                    self.urls[i], self.nodes[i] = url, node
                    engine.replace_server(i, url)
                    self._record()
