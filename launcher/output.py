"""Relaying rank output: every line prefixed with its rank, or written to a per-rank log file.

On a terminal the prefixes are coloured (one rich colour per rank); through a pipe, a file or ssh
they are plain unless `dslaunch` saw a terminal and asked for colour. With `--enable_each_rank_log
DIR` the lines go, unprefixed, to `DIR/<tag>_rank<N>.log` (DeepSpeed's naming) instead of the
console, and the agent keeps the last lines of each rank to quote when that rank fails.
"""
from __future__ import annotations

import collections
import os
import selectors
import time

_PALETTE = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta",
            "bright_green", "bright_yellow", "bright_blue", "bright_red")
TAIL_LINES = 20


def rank_prefix(rank: int, host: str | None, color: bool) -> bytes:
    text = f"[rank{rank}@{host}]:" if host else f"[rank{rank}]:"
    if color:
        from rich.color import ColorSystem  # only on terminals: keeps plain start-up light
        from rich.style import Style
        text = Style(color=_PALETTE[rank % len(_PALETTE)], bold=True).render(
            text, color_system=ColorSystem.STANDARD)
    return text.encode() + b" "


def _write_all(fd: int, data: bytes) -> bool:
    try:
        while data:
            written = os.write(fd, data)
            data = data[written:]
        return True
    except BlockingIOError:
        return True  # a stalled console must not stall supervision; drop the rest
    except OSError:
        return False  # e.g. the ssh channel went away: keep supervising, stop printing


class OutputRelay:
    """Reads every rank's stdout and stderr pipes without blocking and writes whole lines."""

    def __init__(self, host_in_prefix: str | None, color: bool, log_dir: str | None, log_tag: str):
        self._selector = selectors.DefaultSelector()
        self._host = host_in_prefix
        self._color = color
        self._log_dir = log_dir
        self._log_tag = log_tag
        self._logs: dict[int, object] = {}
        self._tails: dict[int, collections.deque] = {}
        self._console_ok = True

    def log_path(self, rank: int) -> str | None:
        if not self._log_dir:
            return None
        return os.path.join(self._log_dir, f"{self._log_tag}_rank{rank}.log")

    def add(self, rank: int, stdout, stderr, header: str = ""):
        self._tails[rank] = collections.deque(maxlen=TAIL_LINES)
        if self._log_dir:
            os.makedirs(self._log_dir, exist_ok=True)
            self._logs[rank] = open(self.log_path(rank), "ab")  # appended across restarts
            if header:
                self._logs[rank].write(header.encode() + b"\n")
        prefix = rank_prefix(rank, self._host, self._color)
        for pipe, console_fd in ((stdout, 1), (stderr, 2)):
            os.set_blocking(pipe.fileno(), False)
            self._selector.register(pipe, selectors.EVENT_READ, [rank, console_fd, prefix, b""])

    def pump(self, timeout: float):
        """Relays what is ready within `timeout`; closes pipes at EOF."""
        if not self._selector.get_map():
            time.sleep(timeout)
            return
        for key, _ in self._selector.select(timeout):
            try:
                data = os.read(key.fileobj.fileno(), 65536)
            except BlockingIOError:
                continue
            state = key.data
            if not data:
                if state[3]:
                    self._emit(state, [state[3]])
                self._selector.unregister(key.fileobj)
                key.fileobj.close()
                continue
            *lines, state[3] = (state[3] + data).split(b"\n")
            self._emit(state, lines)

    def _emit(self, state, lines: list[bytes]):
        rank, console_fd, prefix, _ = state
        self._tails[rank].extend(line.decode(errors="replace") for line in lines)
        if rank in self._logs:
            self._logs[rank].write(b"".join(line + b"\n" for line in lines))
            self._logs[rank].flush()
        elif self._console_ok:
            self._console_ok = _write_all(console_fd, b"".join(prefix + line + b"\n" for line in lines))

    def drain(self, timeout: float):
        """Relays until every pipe reached EOF or `timeout` passed (after the ranks are gone)."""
        deadline = time.monotonic() + timeout
        while self._selector.get_map() and time.monotonic() < deadline:
            self.pump(0.05)

    def tail(self, rank: int) -> list[str]:
        return list(self._tails.get(rank, ()))

    def close(self):
        for pipe in [key.fileobj for key in self._selector.get_map().values()]:
            self._selector.unregister(pipe)
            pipe.close()
        for handle in self._logs.values():
            handle.close()
        self._selector.close()
