"""`dslaunch`'s side of one attempt: start the agents, collect their reports, stop everything.

One attempt ends when every runner process (agent, ssh, pdsh, srun, mpirun) has exited. On the
first failure report, a lost agent, a runner that dies, or SIGINT/SIGTERM/SIGHUP to `dslaunch`, a
`stop` goes to every agent; each stops its ranks (SIGTERM, then SIGKILL after the grace period).
A second signal, or `grace + 5` s without the runners gone, sends `kill`: each agent SIGKILLs its
ranks' process groups at once and exits. Runner processes still alive `KILL_WAIT_S` after that
are SIGKILLed.

[Note: the agent kills the rank groups, not dslaunch] A rank's children (data-loader workers)
live in the rank's process group, which only the agent knows. So even the hurried path asks the
agents, and SIGKILLs runner processes only once they had `KILL_WAIT_S` to do it; an agent killed
anyway (here, or by anyone) leaves its dead man's switch (launcher/deadman.py) to kill the groups.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass

from launcher.control import ControlServer
from launcher.runners import RunnerProcess

RUNNER_EXIT_WAIT_S = 1.0  # lets an agent's own failure report arrive before its ssh's exit code
KILL_WAIT_S = 3.0  # from `kill` to SIGKILL of the runner processes: an agent needs milliseconds


@dataclass
class AttemptResult:
    failure: dict | None  # the first failure: kind, rank, host, node_rank, exitcode, signal, detail
    interrupted_by: int | None
    stopped_in_s: float | None  # from the first failure to the last runner process gone
    nnodes: int

    @property
    def ok(self) -> bool:
        return self.failure is None and self.interrupted_by is None

    @property
    def exit_status(self) -> int:
        if self.interrupted_by:
            return 128 + self.interrupted_by
        return int(self.failure.get("exitcode") or 1) if self.failure else 0


class JobSupervisor:
    def __init__(self, server: ControlServer, nnodes: int, grace_s: float, connect_timeout_s: float,
                 on_all_connected=None):
        self.server = server
        self.on_all_connected = on_all_connected  # e.g. remove the launch file: no agent needs it any more
        self.nnodes = nnodes
        self.grace_s = grace_s
        self.connect_timeout_s = connect_timeout_s
        self.signals: list[int] = []
        self.failure: dict | None = None
        self.stop_at: float | None = None
        self.kill_at: float | None = None  # when `kill` was sent
        self.connected: set[int] = set()
        self.done: set[int] = set()

    def on_signal(self, signum, _frame):
        self.signals.append(signum)

    def run(self, processes: list[RunnerProcess]) -> AttemptResult:
        started = time.monotonic()
        running = [(rp, subprocess.Popen(rp.argv, env=rp.env, stdin=subprocess.DEVNULL,
                                          start_new_session=True)) for rp in processes]
        exited_at: dict[int, float] = {}
        while True:
            self._handle_events(0.1)
            now = time.monotonic()
            if self.signals and self.stop_at is None:
                self._stop("interrupt")
            for rp, popen in running:
                if popen.poll() is not None:
                    exited_at.setdefault(popen.pid, now)
                    self._check_runner_exit(rp, popen, now - exited_at[popen.pid])
            if all(popen.returncode is not None for _, popen in running):
                break
            if self.stop_at is None and len(self.connected) < self.nnodes \
                    and now - started > self.connect_timeout_s:
                missing = sorted(set(range(self.nnodes)) - self.connected)
                self._fail({"kind": "connect", "node_rank": missing[0], "exitcode": 1, "detail":
                            f"node(s) {missing} did not connect within {self.connect_timeout_s:.0f} s"})
            self._escalate(running, now)
        self._handle_events(0.0)
        return self._result(running)

    def _handle_events(self, timeout: float):
        for kind, node, message in self.server.poll(timeout):
            if kind == "closed":
                if node is not None and node not in self.done and self.stop_at is None:
                    self._fail({"kind": "lost", "node_rank": node, "exitcode": 1,
                                "detail": "the node's agent disconnected without a report"})
                continue
            if message["type"] == "hello":
                self.connected.add(node)
                if len(self.connected) == self.nnodes and self.on_all_connected:
                    self.on_all_connected()
                if self.stop_at is not None:  # a late agent must not start training alone
                    self.server.broadcast_stop("failure")
                if self.kill_at is not None:
                    self.server.broadcast_kill()
            elif message["type"] == "failure":
                self._fail(message)
            elif message["type"] == "done":
                self.done.add(node)

    def _check_runner_exit(self, rp: RunnerProcess, popen, exited_for_s: float):
        if popen.returncode == 0 or self.stop_at is not None or exited_for_s < RUNNER_EXIT_WAIT_S:
            return
        if all(node in self.done for node in rp.node_ranks):
            return
        self._fail({"kind": "runner", "node_rank": rp.node_ranks[0], "exitcode": popen.returncode,
                    "detail": f"{rp.label} exited with code {popen.returncode} before its agent "
                              "reported (see its error output above)"})

    def _fail(self, failure: dict):
        if self.failure is None and self.stop_at is None:
            self.failure = failure
            self._stop("hang" if failure.get("kind") == "hang" else "failure")

    def _stop(self, reason: str):
        self.stop_at = time.monotonic()
        self.server.broadcast_stop(reason)

    def _escalate(self, running, now: float):
        """`kill` when the runners outlive the agents' grace period, or at a second signal; then,
        `KILL_WAIT_S` later, SIGKILL of the runner processes still alive."""
        overdue = self.stop_at is not None and now - self.stop_at > self.grace_s + 5
        if self.kill_at is None and (overdue or len(self.signals) >= 2):
            self.kill_at = now
            self.server.broadcast_kill()
        if self.kill_at is None or now - self.kill_at < KILL_WAIT_S:
            return
        for _, popen in running:
            if popen.returncode is None:
                try:
                    os.killpg(popen.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _result(self, running) -> AttemptResult:
        stopped_in = time.monotonic() - self.stop_at if self.stop_at is not None else None
        interrupted = self.signals[0] if self.signals else None
        if self.failure is None and interrupted is None and len(self.done) < self.nnodes:
            missing = sorted(set(range(self.nnodes)) - self.done)
            codes = sorted({popen.returncode for _, popen in running})
            self.failure = {"kind": "runner", "node_rank": missing[0], "exitcode": max(codes) or 1,
                            "detail": f"node(s) {missing} ended without reporting (exit codes {codes})"}
        return AttemptResult(self.failure, interrupted, stopped_in, self.nnodes)
