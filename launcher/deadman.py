"""A dead man's switch for the agent: if the agent dies outright, its ranks' process groups die too.

Each rank runs in its own process group, which holds whatever the rank started (data-loader
workers, `subprocess.Popen` children). `PR_SET_PDEATHSIG` kills the rank itself when its agent is
SIGKILLed, but it fires only in the agent's direct child: the rank's own children would live on as
orphans, holding memory, GPUs and files. Nothing in a dying agent can act, so the agent starts this
small process first (`python -m launcher.deadman`, its own session, so that a signal to the agent's
group leaves it standing) and tells it each rank's process group on its stdin:

    <pgid>\\n    one more group to kill if the agent dies
    disarm\\n    the agent has stopped its ranks itself; exit without acting

The agent holds the only write end of that pipe, so end-of-file without `disarm` means the agent is
gone, however it died; the switch then SIGKILLs every group it was told about and exits. A group
that is already empty is skipped (ProcessLookupError); a group id stays reserved by the kernel while
any member lives, so the groups that matter cannot have been reused.

Not covered here: a child that leaves its rank's process group (`setsid`, `start_new_session=True`),
as with torchrun's process-group kill. The agent itself kills those at its exit (it is their
subreaper, launcher/ranks.py `adopt_orphans`); if it is SIGKILLed they live on, reparented to init.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import launcher

DISARM = b"disarm"
DISARM_WAIT_S = 5.0  # the switch needs milliseconds to read its last line and exit


class DeadManSwitch:
    """The agent's side: start the switch, arm it with each rank's group, disarm it at a clean exit."""

    def __init__(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(launcher.__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        # Its own session: dslaunch's escalation SIGKILLs the agent's whole group, which must not
        # take the switch with it. stdout is not needed; stderr is the agent's, for its one line.
        self._popen = subprocess.Popen([sys.executable, "-m", "launcher.deadman", str(os.getpid())],
                                       env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                       start_new_session=True)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def running(self) -> bool:
        """False once the switch has exited (collected here, so it leaves no zombie under the agent)."""
        return self._popen.poll() is None

    def arm(self, pgid: int):
        self._send(f"{pgid}\n".encode())

    def disarm(self):
        self._send(DISARM + b"\n")
        try:
            self._popen.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self._popen.wait(timeout=DISARM_WAIT_S)
        except subprocess.TimeoutExpired:  # never let the switch hold up the agent's exit
            self._popen.kill()
            self._popen.wait()

    def _send(self, line: bytes):
        try:
            self._popen.stdin.write(line)
            self._popen.stdin.flush()
        except (BrokenPipeError, ValueError):  # the switch is gone; the agent still stops its ranks
            pass


def signal_groups(pgids: list[int], sig: int) -> int:
    """Sends `sig` to each process group; the number of groups that still had members (the agent's
    `signal_rank_groups` sends through here too)."""
    reached = 0
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
            reached += 1
        except (ProcessLookupError, PermissionError):
            pass
    return reached


def main(argv: list[str]) -> int:
    agent_pid = argv[0] if argv else "?"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the agent's fate decides
    pgids: list[int] = []
    for line in sys.stdin.buffer:
        line = line.strip()
        if line == DISARM:
            return 0
        if line.isdigit():
            pgids.append(int(line))
    killed = signal_groups(pgids, signal.SIGKILL)
    if killed:
        try:
            os.write(2, f"dslaunch: agent {agent_pid} died; killed {killed} rank process group(s) "
                        "with everything the ranks had started\n".encode())
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
