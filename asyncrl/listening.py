"""The listening socket of an HTTP server that prints its address before it serves.

`asyncrl serve`, the tool service and `asyncrl view` bind and listen themselves, then hand the
socket to uvicorn: a client that connects while uvicorn still starts waits in the backlog, and
port 0 gives an address to announce. The socket names its protocol (IPPROTO_TCP) because asyncio
turns Nagle's algorithm off (TCP_NODELAY) only on connections whose socket says TCP, and
`socket.socket(AF_INET, SOCK_STREAM)` says 0. With Nagle on, a reply's body, written after its
headers, waits for the client's delayed ACK on every request of a kept-alive connection.
"""

from __future__ import annotations

import socket


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket bound to (`host`, `port`; 0 picks a free port) and listening with room for
    `backlog` waiting connections. Raises OSError if the address cannot be bound."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock
