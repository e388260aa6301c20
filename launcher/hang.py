"""Hang detection: the agent's heartbeat store and the "no progress" clock.

With `--hang_timeout`, the agent hosts a `torch.distributed.TCPStore` on 127.0.0.1 and tells its
ranks where (DSTRAIN_HEARTBEAT_ADDR). `engine.heartbeat.beat(step)` sets `heartbeat/<RANK>` to a
new value on every call. A hang is declared when no local rank's key changed for `timeout`
seconds. The clock starts at the node's first heartbeat: start-up (imports, rendezvous, loading a
checkpoint) can take far longer than a step and is bounded by torch.distributed's own timeouts, so
a timeout sized for steps must not kill a job that is still loading. A rank whose key exists has registered faulthandler on SIGUSR1
(beat() does that first), so the agent may ask it for a stack dump without killing it.

[Note: start-up cost] The listening socket is bound before the ranks start (so its port can go in
their environment) and handed to the TCPStore afterwards (`master_listen_fd`), so the agent's own
`import torch` overlaps the ranks' start-up instead of delaying it.
"""
from __future__ import annotations

import socket
import time


class HeartbeatWatch:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._store = None
        self._ranks: list[int] = []
        self._last_value: dict[int, bytes] = {}
        self._last_change: dict[int, float] = {}
        self._next_check = 0.0

    def start(self, ranks: list[int]):
        """Opens the store (imports torch); the clock starts at the first heartbeat."""
        from datetime import timedelta

        from torch.distributed import TCPStore

        port = int(self.address.rsplit(":", 1)[1])
        self._store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=30), master_listen_fd=self._listener.detach())
        self._ranks = list(ranks)

    def _refresh(self, now: float):
        for rank in self._ranks:
            key = f"heartbeat/{rank}"
            if not self._store.check([key]):
                continue
            value = self._store.get(key)
            if value != self._last_value.get(rank):
                self._last_value[rank] = value
                self._last_change[rank] = now

    def is_hung(self, now: float | None = None) -> bool:
        """Checks at most a few times per second; True once no rank progressed for the timeout."""
        now = time.monotonic() if now is None else now
        if self._store is None or now < self._next_check:
            return False
        self._next_check = now + min(0.5, self.timeout_s / 10)
        self._refresh(now)
        return bool(self._last_change) and now - max(self._last_change.values()) > self.timeout_s

    def stalled_for(self) -> float:
        return time.monotonic() - max(self._last_change.values(), default=time.monotonic())

    def beating_ranks(self) -> set[int]:
        """Ranks that reported at least once (and so have the SIGUSR1 stack-dump handler)."""
        return set(self._last_value)

    def last_steps(self) -> dict[int, str]:
        return {rank: value.decode().split(":", 1)[0] for rank, value in self._last_value.items()}

    def close(self):
        self._store = None
        if self._listener.fileno() >= 0:
            self._listener.close()
