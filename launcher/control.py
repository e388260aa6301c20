"""The control connection between `dslaunch` and its per-node agents.

Each agent keeps one TCP connection to `dslaunch`. Its first line is the attempt's secret token
(never on any command line: launcher/handoff.py), then both sides exchange newline-delimited JSON:

    agent -> dslaunch   {"type": "hello", "node_rank", "host", "pid"}
                        {"type": "failure", ...Failure fields...}   first failure of the node
                        {"type": "done", "node_rank"}                all local ranks exited 0
    dslaunch -> agent   {"type": "stop", "reason": "failure" | "hang" | "interrupt"}
                        {"type": "kill"}   SIGKILL every rank's process group now (a second
                                           signal, or the grace period is over), then exit

[Note: why a plain socket and not a TCPStore] The connection itself carries the liveness both ways:
if `dslaunch` dies (even by SIGKILL) every agent sees EOF and stops its ranks, and if a node dies
`dslaunch` sees EOF and stops the others, with no polling interval. A TCPStore would need an
`import torch` (about 1.6 s here) in `dslaunch` and in every agent before the first rank could
start, which is the whole start-up budget torchrun has. Tensor traffic never goes through here.
"""
from __future__ import annotations

import hmac
import json
import selectors
import socket
import sys
import time

MAX_TOKEN_LINE = 256  # bytes a connection may send before its token line is complete
AUTH_TIMEOUT_S = 10.0  # seconds a connection may take to send its token line
MAX_PENDING = 64  # connections accepted but not yet authenticated
MAX_MESSAGE = 1 << 20  # bytes of one message line from an authenticated agent (failure reports quote log lines)


class ConnectionLost(Exception):
    """The peer closed the control connection."""


class ProtocolError(Exception):
    """The peer sent something that is not a control message."""


class _LineBuffer:
    def __init__(self, limit: int = MAX_MESSAGE):
        self._pending = b""
        self._limit = limit

    def feed(self, data: bytes) -> list[dict]:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        if len(self._pending) > self._limit or any(len(line) > self._limit for line in lines):
            raise ProtocolError(f"a line longer than {self._limit} bytes")
        return [parse_message(line) for line in lines if line.strip()]


def parse_message(line: bytes) -> dict:
    try:
        message = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("a line that is not JSON") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("a JSON line that is not a message (an object with a 'type')")
    return message


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.setblocking(True)
        sock.sendall(data)
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(False)


def _encode(message: dict) -> bytes:
    return json.dumps(message).encode() + b"\n"


class _Peer:
    """One accepted connection: unauthenticated (token line pending) until `node` is set."""

    def __init__(self, address):
        self.address = address
        self.deadline = time.monotonic() + AUTH_TIMEOUT_S
        self.before_token = b""
        self.messages = _LineBuffer()
        self.authenticated = False
        self.node: int | None = None  # set by a valid hello


class ControlServer:
    """`dslaunch`'s side: accepts agents, yields their messages, broadcasts `stop`."""

    def __init__(self, bind_addr: str, token: str, log=None):
        self._token = token.encode()
        family = socket.AF_INET6 if ":" in bind_addr else socket.AF_INET
        self._listener = socket.create_server((bind_addr, 0), family=family, backlog=1024)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._peers: dict[socket.socket, _Peer] = {}
        self.agents: dict[int, socket.socket] = {}  # node rank -> connection, after a valid hello
        self._log = log or (lambda text: print(f"dslaunch: {text}", file=sys.stderr, flush=True))

    def poll(self, timeout: float) -> list[tuple[str, int | None, dict]]:
        """Events: ("message", node_rank, msg) and ("closed", node_rank, {}) for lost agents."""
        events = []
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj in self._peers:  # not dropped earlier in this round
                events.extend(self._receive(key.fileobj))
        self._expire(time.monotonic())
        return events

    def _receive(self, conn) -> list:
        peer = self._peers[conn]
        try:
            data = conn.recv(65536 if peer.authenticated else MAX_TOKEN_LINE + 1)
        except BlockingIOError:
            return []
        except OSError:
            data = b""
        if not data:
            node = peer.node
            self._drop(conn)
            return [("closed", node, {})] if node is not None else []
        try:
            return self._consume(conn, peer, data)
        except ProtocolError as err:
            node = peer.node
            self._reject(conn, f"sent {err}")
            return [("closed", node, {})] if node is not None else []

    def _consume(self, conn, peer: _Peer, data: bytes) -> list:
        if not peer.authenticated:
            peer.before_token += data  # bounded: at most MAX_TOKEN_LINE + 1 bytes per recv, checked below
            line, newline, data = peer.before_token.partition(b"\n")
            if not newline:
                if len(line) > MAX_TOKEN_LINE:
                    raise ProtocolError(f"more than {MAX_TOKEN_LINE} bytes without a token line")
                return []
            if not hmac.compare_digest(line, self._token):
                raise ProtocolError("a wrong token")
            peer.authenticated, peer.before_token = True, b""
        events = []
        for message in peer.messages.feed(data):
            event = self._handle(conn, peer, message)
            if event:
                events.append(event)
        return events

    def _handle(self, conn, peer: _Peer, message: dict):
        if peer.node is None:
            node = message.get("node_rank")
            if message["type"] != "hello" or not isinstance(node, int) or isinstance(node, bool) or node < 0:
                raise ProtocolError("a first message that is not a hello with a node rank")
            peer.node = node
            self.agents[node] = conn
        return ("message", peer.node, message)

    def _accept(self):
        try:
            conn, address = self._listener.accept()
        except (BlockingIOError, OSError):
            return
        pending = [c for c, p in self._peers.items() if not p.authenticated]
        if len(pending) >= MAX_PENDING:  # dict order: the oldest first
            self._reject(pending[0], f"was one of more than {MAX_PENDING} connections without a token")
        conn.setblocking(False)
        self._peers[conn] = _Peer(address)
        self._selector.register(conn, selectors.EVENT_READ, None)

    def _expire(self, now: float):
        for conn, peer in list(self._peers.items()):
            if not peer.authenticated and now > peer.deadline:
                self._reject(conn, f"sent no token within {AUTH_TIMEOUT_S:.0f} s")

    def _reject(self, conn, why: str):
        peer = self._peers[conn]
        where = ":".join(str(part) for part in peer.address[:2]) if peer.address else "?"
        self._log(f"dropped a control connection from {where}: it {why}")
        self._drop(conn)

    def _drop(self, conn):
        self._selector.unregister(conn)
        peer = self._peers.pop(conn, None)
        if peer is not None and peer.node is not None and self.agents.get(peer.node) is conn:
            del self.agents[peer.node]
        conn.close()

    def broadcast_stop(self, reason: str):
        self._broadcast({"type": "stop", "reason": reason})

    def broadcast_kill(self):
        self._broadcast({"type": "kill"})

    def _broadcast(self, message: dict):
        for conn in list(self.agents.values()):
            _send(conn, _encode(message))

    def close(self):
        for conn in list(self._peers):
            self._drop(conn)
        self._selector.unregister(self._listener)
        self._listener.close()
        self._selector.close()


class ControlClient:
    """The agent's side: one connection, retried until `connect_timeout` while dslaunch starts."""

    def __init__(self, address: str, token: str, hello: dict, connect_timeout: float = 30.0):
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
        _send(self._sock, token.encode() + b"\n" + _encode(hello))

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, message: dict) -> bool:
        return _send(self._sock, _encode(message))

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
            try:
                messages.extend(self._buffer.feed(data))
            except ProtocolError as err:
                raise ConnectionLost(f"dslaunch sent {err}") from None

    def close(self):
        self._sock.close()
