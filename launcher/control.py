"""The control connection between `dslaunch` and its per-node agents.

Each agent keeps one TCP connection to `dslaunch` and exchanges newline-delimited JSON messages:

    agent -> dslaunch   {"type": "hello", "token", "node_rank", "host", "pid"}
                        {"type": "failure", ...Failure fields...}   first failure of the node
                        {"type": "done", "node_rank"}                all local ranks exited 0
    dslaunch -> agent   {"type": "stop", "reason": "failure" | "hang" | "interrupt"}

[Note: why a plain socket and not a TCPStore] The connection itself carries the liveness both ways:
if `dslaunch` dies (even by SIGKILL) every agent sees EOF and stops its ranks, and if a node dies
`dslaunch` sees EOF and stops the others, with no polling interval. A TCPStore would need an
`import torch` (about 1.6 s here) in `dslaunch` and in every agent before the first rank could
start, which is the whole start-up budget torchrun has. Tensor traffic never goes through here.
"""
from __future__ import annotations

import json
import selectors
import socket
import time


class ConnectionLost(Exception):
    """The peer closed the control connection."""


class _LineBuffer:
    def __init__(self):
        self._pending = b""

    def feed(self, data: bytes) -> list[dict]:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


def _send(sock: socket.socket, message: dict) -> bool:
    try:
        sock.setblocking(True)
        sock.sendall(json.dumps(message).encode() + b"\n")
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(False)


class ControlServer:
    """`dslaunch`'s side: accepts agents, yields their messages, broadcasts `stop`."""

    def __init__(self, bind_addr: str, token: str):
        self.token = token
        self._listener = socket.create_server((bind_addr, 0), backlog=1024)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._buffers: dict[socket.socket, _LineBuffer] = {}
        self.agents: dict[int, socket.socket] = {}  # node rank -> connection, after a valid hello
        self._node_of: dict[socket.socket, int] = {}

    def poll(self, timeout: float) -> list[tuple[str, int | None, dict]]:
        """Events: ("message", node_rank, msg) and ("closed", node_rank, {}) for lost agents."""
        events = []
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self._listener:
                self._accept()
                continue
            conn = key.fileobj
            try:
                data = conn.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                events.append(("closed", self._node_of.get(conn), {}))
                self._drop(conn)
                continue
            for message in self._buffers[conn].feed(data):
                event = self._handle(conn, message)
                if event:
                    events.append(event)
        return events

    def _accept(self):
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        self._buffers[conn] = _LineBuffer()
        self._selector.register(conn, selectors.EVENT_READ, None)

    def _handle(self, conn, message):
        if conn not in self._node_of:
            if message.get("type") != "hello" or message.get("token") != self.token:
                self._drop(conn)  # a stray connection, not one of our agents
                return None
            self._node_of[conn] = int(message["node_rank"])
            self.agents[int(message["node_rank"])] = conn
        return ("message", self._node_of[conn], message)

    def _drop(self, conn):
        self._selector.unregister(conn)
        self._buffers.pop(conn, None)
        node = self._node_of.pop(conn, None)
        if node is not None and self.agents.get(node) is conn:
            del self.agents[node]
        conn.close()

    def broadcast_stop(self, reason: str):
        for conn in list(self.agents.values()):
            _send(conn, {"type": "stop", "reason": reason})

    def close(self):
        for conn in list(self._buffers):
            self._drop(conn)
        self._selector.unregister(self._listener)
        self._listener.close()
        self._selector.close()


class ControlClient:
    """The agent's side: one connection, retried until `connect_timeout` while dslaunch starts."""

    def __init__(self, address: str, hello: dict, connect_timeout: float = 30.0):
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5)
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise ConnectionLost(f"cannot reach dslaunch at {address}: {err}") from None
                time.sleep(0.2)
        self._sock.setblocking(False)
        self._buffer = _LineBuffer()
        self.send(hello)

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, message: dict) -> bool:
        return _send(self._sock, message)

    def receive(self) -> list[dict]:
        """Messages that arrived so far; raises ConnectionLost once dslaunch is gone."""
        messages = []
        while True:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                return messages
            except OSError:
                data = b""
            if not data:
                if messages:
                    return messages
                raise ConnectionLost("the connection to dslaunch was closed")
            messages.extend(self._buffer.feed(data))

    def close(self):
        self._sock.close()
