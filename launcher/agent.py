"""`python -m launcher.agent`: the per-node supervisor that `dslaunch` starts on every node.

Not meant to be typed by hand (`dslaunch --dry_run` prints the exact command lines). The agent

1. connects back to `dslaunch` (`--control HOST:PORT`); losing that connection stops the node;
2. spawns the node's ranks with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK,
   MASTER_ADDR, MASTER_PORT, CUDA_VISIBLE_DEVICES (and DSTRAIN_HEARTBEAT_ADDR with a hang timeout,
   DSTRAIN_RESTART_COUNT always), each in its own process group, after starting a dead man's
   switch that kills those groups if the agent itself is killed outright (launcher/deadman.py);
3. relays their output line by line with a rank prefix, or into per-rank log files;
4. supervises: the first rank that exits non-zero, or no progress for `--hang_timeout` seconds, is
   reported to `dslaunch`, which stops every node; a `stop` from `dslaunch`, SIGTERM, SIGINT or SIGHUP
   stops the node's ranks (SIGTERM, then SIGKILL after a grace period); a `kill` from `dslaunch` or
   a second signal cuts the grace period short: every rank's process group is SIGKILLed at once.

Exit status: 0 when every local rank exited 0; the failing rank's status (128+N for signal N);
124 after a hang; 1 when stopped because of another node; 128+N when the agent got signal N.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time

from launcher.control import ConnectionLost, ControlClient
from launcher.deadman import DeadManSwitch
from launcher.handoff import read_launch_file
from launcher.output import OutputRelay
from launcher.ranks import (TERM_GRACE_S, RankProcess, describe_returncode, literal_script_args, rank_environment,
                            signal_rank_groups, spawn_rank, stop_ranks, core_sets,
                            adopt_orphans, descendants, kill_escaped, reap_adopted)
from launcher.world import WorldInfo

HANG_EXIT_STATUS = 124
STACK_DUMP_WAIT_S = 1.5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launcher.agent", description=__doc__.split("\n")[0])
    parser.add_argument("--world_info", required=True, help="base64 rank map from dslaunch")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--node_rank", type=int, help="this node's rank")
    where.add_argument("--node_host", help="this node's name in the rank map (pdsh's %%h)")
    where.add_argument("--node_rank_env", help="variable holding the node rank (OMPI_COMM_WORLD_RANK)")
    where.add_argument("--node_host_env", help="variable holding this node's name (SLURMD_NODENAME)")
    parser.add_argument("--master_addr", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--control", default="", help="HOST:PORT of dslaunch's control socket")
    parser.add_argument("--launch_file", default="", help="the token and environment (launcher/handoff.py)")
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--hang_timeout", type=float, default=0.0)
    parser.add_argument("--term_grace", type=float, default=TERM_GRACE_S, help="SIGTERM to SIGKILL, seconds")
    parser.add_argument("--log_dir", default="")
    parser.add_argument("--log_tag", default="dslaunch")
    parser.add_argument("--color", action="store_true")
    parser.add_argument("--bind_cores_to_rank", action="store_true")
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--no_python", action="store_true")
    parser.add_argument("user_script")
    parser.add_argument("user_args", nargs=argparse.REMAINDER)
    return parser


def resolve_node_rank(args, world: WorldInfo) -> int:
    if args.node_rank is not None:
        return args.node_rank
    if args.node_host is not None:
        return world.node_rank_of(args.node_host)
    if args.node_host_env is not None:
        return world.node_rank_of(os.environ[args.node_host_env])
    return int(os.environ[args.node_rank_env])


def rank_command(args) -> list[str]:
    if args.no_python:
        return [args.user_script, *args.user_args]
    if args.module:
        return [sys.executable, "-u", "-m", args.user_script, *args.user_args]
    return [sys.executable, "-u", args.user_script, *args.user_args]


class NodeAgent:
    def __init__(self, args, world: WorldInfo, node_rank: int):
        self.args = args
        self.world = world
        self.node_rank = node_rank
        self.host = world.nodes[node_rank][0]
        self.ranks: list[RankProcess] = []
        self.control: ControlClient | None = None
        self.received_signal: int | None = None
        self.signal_count = 0
        self.kill_now = False  # dslaunch sent `kill`: no grace period
        self.control_lost = False
        self.heartbeat = None
        self.deadman: DeadManSwitch | None = None
        if args.hang_timeout > 0:
            from launcher.hang import HeartbeatWatch
            self.heartbeat = HeartbeatWatch(args.hang_timeout)
        multi_node = world.nnodes > 1
        self.relay = OutputRelay(self.host if multi_node else None, args.color, args.log_dir or None,
                                 args.log_tag)

    def say(self, text: str):
        try:
            os.write(2, f"dslaunch[node{self.node_rank} {self.host}]: {text}\n".encode())
        except OSError:
            pass

    def spawn(self):
        extra = {"DSTRAIN_RESTART_COUNT": str(self.args.attempt)}
        if self.heartbeat:
            extra["DSTRAIN_HEARTBEAT_ADDR"] = self.heartbeat.address
        placements = self.world.placements(self.node_rank)
        cores = core_sets(len(placements)) if self.args.bind_cores_to_rank else [None] * len(placements)
        command = rank_command(self.args)
        adopt_orphans()
        self._start_deadman()
        for placement, core_set in zip(placements, cores):
            env = rank_environment(os.environ, placement, self.world, self.args.master_addr,
                                   self.args.master_port, extra)
            proc = spawn_rank(command, env, placement, core_set)
            self.ranks.append(proc)
            if self.deadman:
                self.deadman.arm(proc.popen.pid)  # the rank's group id is its pid (its own session)
            self.relay.add(placement.rank, proc.popen.stdout, proc.popen.stderr,
                           header=f"===== dslaunch attempt {self.args.attempt} =====")
        for proc in self.ranks:  # after every fork: the preexec hook must not race a thread
            proc.watch()
        if self.heartbeat:
            self.heartbeat.start([proc.rank for proc in self.ranks])

    def _start_deadman(self):
        """Before the first rank: if this agent is SIGKILLed, the switch kills the ranks' groups
        (launcher/deadman.py); PDEATHSIG alone would orphan the ranks' children."""
        try:
            self.deadman = DeadManSwitch()
        except OSError as err:
            self.say(f"cannot start the dead man's switch ({err}); if this agent is killed outright, "
                     "children of its ranks may outlive it")

    def _own_children(self) -> set[int]:
        """The children this agent started and still waits for itself: ranks their waiter threads have not
        collected, and the dead man's switch. A zombie of theirs stops reap_adopted's walk, so a rank already
        collected is left out (its pid may be reused), and a switch that died is collected here: it is the
        agent's oldest child, whose zombie would have kept every orphan behind it uncollected for good."""
        if self.deadman and not self.deadman.running():
            self.say("the dead man's switch exited; if this agent is killed outright, children of its ranks "
                     "may outlive it")
            self.deadman = None
        own = {proc.popen.pid for proc in self.ranks if proc.popen.returncode is None}
        return own | ({self.deadman.pid} if self.deadman else set())

    def stop_everything(self):
        """The last word of every exit: no rank group left behind, nor anything that left one, then
        the switch is disarmed."""
        escaped = descendants(self._own_children())  # group members too: killed twice, harmlessly
        signal_rank_groups(self.ranks, signal.SIGKILL)
        kill_escaped(escaped)
        if self.deadman:
            self.deadman.disarm()

    def run(self) -> int:
        """Supervises until the ranks finish, fail, hang, or a stop arrives; returns the exit status."""
        try:
            self.spawn()
        except OSError as err:
            self.say(f"cannot start the ranks: {err}")
            self._report({"kind": "spawn", "rank": self.world.placements(self.node_rank)[0].rank,
                          "exitcode": 127, "detail": f"cannot start the ranks: {err}"})
            self._teardown()
            return 127
        while True:
            self.relay.pump(0.1)
            reap_adopted(self._own_children())
            stop_reason = self._stop_reason()
            if stop_reason:
                if stop_reason == "hang" and not self.kill_now:
                    self._dump_stacks()
                self._teardown()
                return 128 + self.received_signal if self.received_signal else 1
            failed = self._first_failed_rank()
            if failed is not None:
                return self._fail_with(failed)
            if all(proc.returncode == 0 for proc in self.ranks):
                self.relay.drain(2.0)
                if self.control:
                    self.control.send({"type": "done", "node_rank": self.node_rank})
                return 0
            if self.heartbeat and self.heartbeat.is_hung():
                return self._hang()

    def _stop_reason(self) -> str | None:
        if self.received_signal:
            return "signal"
        return self._read_control()

    def _read_control(self) -> str | None:
        """The reason of a `stop` or `kill` from dslaunch (`kill` also sets `kill_now`), "lost", or None."""
        if not self.control or self.control_lost:
            return None
        reason = None
        try:
            for message in self.control.receive():
                if message.get("type") == "kill":
                    self.kill_now = True
                if message.get("type") in ("stop", "kill"):
                    reason = reason or message.get("reason", "kill")
        except ConnectionLost:
            self.control_lost = True
            self.say("lost the connection to dslaunch; stopping this node's ranks")
            return "lost"
        return reason

    def _hurried(self) -> bool:
        """Checked during the grace period: a `kill` or a second signal ends it at once."""
        self._read_control()
        return self.kill_now or self.signal_count >= 2

    def _first_failed_rank(self) -> RankProcess | None:
        exited = [proc for proc in self.ranks if proc.poll()]
        failed = [proc for proc in exited if proc.returncode != 0]
        failed.sort(key=lambda proc: proc.exited_at)  # the first to die is the cause
        return failed[0] if failed else None

    def _fail_with(self, proc: RankProcess) -> int:
        status, signame, words = describe_returncode(proc.returncode)
        self.say(f"rank {proc.rank} {words}; stopping the node's {len(self.ranks)} rank(s)")
        self._report({"kind": "exit", "rank": proc.rank, "local_rank": proc.placement.local_rank,
                      "exitcode": status, "signal": signame, "detail": words,
                      "log": self.relay.log_path(proc.rank),
                      # clipped: a control message is at most control.MAX_MESSAGE bytes
                      "tail": [line[:2000] for line in self.relay.tail(proc.rank)[-5:]]})
        self._teardown()
        return status

    def _hang(self) -> int:
        steps = self.heartbeat.last_steps()
        last = ", ".join(f"rank {r} at step {s}" for r, s in sorted(steps.items())) or "no heartbeat yet"
        detail = f"no rank made progress for {self.heartbeat.stalled_for():.1f} s (last: {last})"
        self.say(f"hang: {detail}; dumping Python stacks")
        self._report({"kind": "hang", "rank": self.ranks[0].rank, "exitcode": HANG_EXIT_STATUS,
                      "detail": detail})
        self._dump_stacks()
        self._teardown()
        return HANG_EXIT_STATUS

    def _dump_stacks(self):
        """SIGUSR1 makes faulthandler print every thread's stack to the rank's stderr."""
        beating = self.heartbeat.beating_ranks() if self.heartbeat else set()
        live = [proc for proc in self.ranks if proc.returncode is None]
        for proc in live:
            if proc.rank in beating:
                os.kill(proc.popen.pid, signal.SIGUSR1)
                os.kill(proc.popen.pid, signal.SIGCONT)  # a stopped rank dumps once woken
            else:
                self.say(f"rank {proc.rank} never sent a heartbeat, so it has no stack-dump handler "
                         "(engine.heartbeat.install_stack_dump()); no stack for it")
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < deadline:
            self.relay.pump(0.05)

    def _report(self, failure: dict):
        failure.update({"type": "failure", "node_rank": self.node_rank, "host": self.host,
                        "time": time.time()})
        if self.control:
            self.control.send(failure)

    def _teardown(self):
        stop_ranks(self.ranks, self.args.term_grace, self.relay.pump, self._hurried)
        self.relay.drain(1.0)
        self.relay.close()
        if self.heartbeat:
            self.heartbeat.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.user_args = literal_script_args(argv, args.user_script, args.user_args)
    token = ""
    if args.launch_file:
        try:
            token, forwarded = read_launch_file(args.launch_file)
        except (OSError, ValueError, KeyError) as err:
            print(f"dslaunch agent: cannot read the launch file {args.launch_file}: {err}", file=sys.stderr)
            return 1
        os.environ.update(forwarded)  # what `env K=V` words used to set, now off the command line
    world = WorldInfo.decode(args.world_info)
    agent = NodeAgent(args, world, resolve_node_rank(args, world))

    def on_signal(signum, _frame):
        agent.received_signal = agent.received_signal or signum
        agent.signal_count += 1

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    if args.control:
        hello = {"type": "hello", "node_rank": agent.node_rank,
                 "host": agent.host, "hostname": socket.gethostname(), "pid": os.getpid()}
        try:
            agent.control = ControlClient(args.control, token, hello)
        except ConnectionLost as err:
            agent.say(str(err))
            return 1
    try:
        return agent.run()
    finally:
        agent.stop_everything()  # never leave a rank behind, whatever happened


if __name__ == "__main__":
    sys.exit(main())
