"""LocalServers with real subprocesses: a server whose port another process took before it bound
it starts again on another port; any other failure is one error with the server's log."""

from __future__ import annotations

import logging
import socket
import sys

import httpx
import pytest

from asyncrl.inference.backend_protocol import ServerCommand, free_port
from asyncrl.launch.local_servers import LocalServers, ServerStartError

# a server on argv[1] answering 200 on /health (http.server: "Address already in use" if taken)
SERVE = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_whose_port_was_taken_starts_again_on_another(tmp_path, caplog):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    # check_server_python's call, then two starts on the taken port, then a free one
    ports = iter([taken.getsockname()[1]] * 3)

    def make(api_key: str) -> ServerCommand:
        port = next(ports, None) or free_port()
        return ServerCommand(argv=[sys.executable, "-c", SERVE, str(port)], port=port)

    with caplog.at_level(logging.WARNING, logger="asyncrl.launch.local_servers"), \
            LocalServers(make, 1, tmp_path / "logs", startup_timeout_s=60) as servers:
        url = servers.urls[0]
        assert url != f"http://127.0.0.1:{taken.getsockname()[1]}"
        assert httpx.get(url + "/health").status_code == 200
    taken.close()
    clashes = [r for r in caplog.records if "was taken before it bound it" in r.getMessage()]
    assert len(clashes) == 2  # the first two starts; the third bound its port


def test_a_port_taken_every_time_and_any_other_failure_are_one_error(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    starts = []

    def clash(api_key: str) -> ServerCommand:
        starts.append(port)
        return ServerCommand(argv=[sys.executable, "-c", SERVE, str(port)], port=port)

    with pytest.raises(ServerStartError, match="(?i)address already in use") as err:
        LocalServers(clash, 1, tmp_path / "a", startup_timeout_s=60).start()
    assert err.value.port_taken and len(starts) == 1 + 3  # the check, then three starts
    taken.close()

    def broken(api_key: str) -> ServerCommand:
        starts.append(0)
        return ServerCommand(argv=[sys.executable, "-c", "raise SystemExit('no model')"],
                             port=free_port())

    starts.clear()
    with pytest.raises(ServerStartError, match="(?s)exited with status 1.*no model") as err:
        LocalServers(broken, 1, tmp_path / "b", startup_timeout_s=60).start()
    assert not err.value.port_taken and len(starts) == 2  # the check and one start
