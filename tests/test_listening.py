"""The servers' listening socket (asyncrl/listening.py), on real sockets on 127.0.0.1: asyncio
turns Nagle's algorithm off on its connections, which a plain `socket.socket(AF_INET,
SOCK_STREAM)` does not get (the kept-alive stall benchmarks/bench_http_keepalive.py measures)."""

import asyncio
import os
import socket

import pytest

from asyncrl.listening import listening_socket


def nodelay_of_accepted(sock: socket.socket) -> int:
    """TCP_NODELAY of the server side of one connection asyncio accepted on `sock`."""
    async def run() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set_result(writer.get_extra_info("socket").getsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handler, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await accepted
            writer.close()
        return value

    return asyncio.run(run())


def test_connections_of_the_listening_socket_send_without_nagle():
    assert nodelay_of_accepted(listening_socket("127.0.0.1", 0, 8)) != 0
    plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # no protocol named
    plain.bind(("127.0.0.1", 0))
    plain.listen(8)
    assert nodelay_of_accepted(plain) == 0


def test_a_taken_port_raises_and_leaves_no_socket_open():
    held = listening_socket("127.0.0.1", 0, 8)
    try:
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(OSError):
            listening_socket("127.0.0.1", held.getsockname()[1], 8)
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        held.close()
