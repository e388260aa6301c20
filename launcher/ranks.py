"""Starting, watching and stopping the rank processes of one node (used by the agent).

Each rank runs in its own session (process group), so stopping a rank also stops whatever it
started (data-loader workers, compilers), and a Ctrl-C typed into the launching terminal reaches
only `dslaunch`, which then stops everything in order.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import psutil

from launcher.deadman import signal_groups
from launcher.world import RankPlacement, WorldInfo

# Engines of other launchers read these before RANK; a rank started by an agent under mpirun must
# not look like MPI rank <node rank>.
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_HIDDEN_PREFIXES = ("OMPI_COMM_WORLD_", "PMI_RANK", "PMIX_RANK", "PMI_SIZE")


@dataclass
class RankProcess:
    placement: RankPlacement
    popen: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    returncode: int | None = None
    exited_at: float | None = None  # set by the waiter thread the moment the process ends

    @property
    def rank(self) -> int:
        return self.placement.rank

    def watch(self):
        """Waits in a thread, so that the order in which ranks died is exact, not per poll tick."""
        def wait():
            self.popen.wait()
            self.exited_at = time.monotonic()

        threading.Thread(target=wait, name=f"wait-rank{self.rank}", daemon=True).start()

    def poll(self) -> bool:
        """True when the process has just been found to have exited."""
        if self.returncode is None and self.exited_at is not None:
            self.returncode = self.popen.returncode
            return True
        return False


def literal_script_args(argv: list[str], user_script: str, parsed: list[str]) -> list[str]:
    """Everything after the script (or module) name in `argv`, verbatim.

    argparse's REMAINDER drops a `--` that directly follows the script (`x.py -- a` gives `["a"]`,
    where `python x.py -- a` gives the script `["--", "a"]`), and which `--` it drops has changed
    between Python versions. `parsed` is `argv`'s tail less at most that one `--`, so the tail is
    found by where the script name stands.
    """
    n = len(argv) - len(parsed)
    if n >= 1 and argv[n - 1] == user_script:
        return list(argv[n:])
    if n >= 2 and argv[n - 1] == "--" and argv[n - 2] == user_script:
        return list(argv[n - 1:])
    return list(parsed)


def describe_returncode(returncode: int) -> tuple[int, str | None, str]:
    """(shell exit status, signal name or None, words) for a Popen return code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return 128 - returncode, name, f"was killed by signal {-returncode} ({name})"
    return returncode, None, f"exited with code {returncode}"


def rank_environment(base: dict[str, str], placement: RankPlacement, world: WorldInfo,
                     master_addr: str, master_port: int, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith(_HIDDEN_PREFIXES)}
    node_slots = world.nodes[placement.node_rank][1]
    env.update({
        "RANK": str(placement.rank),
        "LOCAL_RANK": str(placement.local_rank),
        "WORLD_SIZE": str(world.world_size),
        "LOCAL_WORLD_SIZE": str(len(node_slots)),
        "NODE_RANK": str(placement.node_rank),
        "GROUP_RANK": str(placement.node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        # As DeepSpeed does: every rank of the node sees the node's chosen devices, in slot order,
        # and picks its own with LOCAL_RANK. Harmless on CPU-only machines. An empty value the node was
        # given hides every GPU (a CPU run on a GPU machine): the slots are then labels, and it stays empty.
        "CUDA_VISIBLE_DEVICES": "" if base.get("CUDA_VISIBLE_DEVICES") == "" else ",".join(node_slots),
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra)
    return env


def core_sets(local_world_size: int) -> list[list[int]]:
    """Disjoint CPU sets per local rank (round robin when there are fewer cores than ranks)."""
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = len(cpus) // local_world_size
    if per_rank == 0:
        return [[cpus[i % len(cpus)]] for i in range(local_world_size)]
    return [cpus[i * per_rank:(i + 1) * per_rank] for i in range(local_world_size)]


def _die_with_parent():
    """Linux: the kernel SIGKILLs the rank if its agent dies, even by SIGKILL. Only the rank: its
    children are killed by the agent's dead man's switch (launcher/deadman.py)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):
        pass


def adopt_orphans():
    """Linux: makes the agent the subreaper of everything it starts, so that a process which left its
    rank's session (`setsid`, `start_new_session=True`: out of reach of the group kill) is reparented
    to the agent, not to init, when its rank exits, and `kill_escaped` still finds it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    except (OSError, AttributeError):
        pass


def reap_adopted(keep: set[int]) -> int:
    """Collects the orphans adopt_orphans made the agent's children once they exit: unreaped, each stays
    a zombie under the agent, and a long job whose ranks start and leave background processes fills the
    process table. Peeks without reaping (WNOWAIT) and reaps only pids outside `keep` (the ranks and the
    dead man's switch, which their Popen objects wait for: reaping one here would lose its exit status);
    stops at the first of those, which its own waiter collects within moments. One syscall per call when
    there is nothing to collect. Returns how many it reaped."""
    reaped = 0
    while True:
        try:
            found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (ChildProcessError, AttributeError):  # no children at all; not Linux
            return reaped
        if found is None or found.si_pid in keep:
            return reaped
        try:
            os.waitpid(found.si_pid, os.WNOHANG)
        except ChildProcessError:
            return reaped
        reaped += 1


def descendants(keep: set[int]) -> list[psutil.Process]:
    """Every living descendant of the agent but the pids in `keep`: taken before the rank groups are
    killed, it holds what left a live rank's session, still under that rank (adopt_orphans)."""
    try:
        procs = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    return [p for p in procs if p.pid not in keep and _alive(p)]


def kill_escaped(procs: list[psutil.Process]) -> None:
    """SIGKILLs `procs` (psutil.Process remembers each start time: a recycled pid is never hit). Not
    waited for: a killed grandchild stays a zombie until its parent or init reaps it, and psutil would
    poll it to the timeout; the agent's exit hands those it adopted to init."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def spawn_rank(command: list[str], env: dict[str, str], placement: RankPlacement,
               cores: list[int] | None) -> RankProcess:
    def prepare_child():  # runs in the child between fork and exec; the agent is single-threaded
        _die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)

    if cores:
        env = dict(env, OMP_NUM_THREADS=str(len(cores)))
    popen = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True, preexec_fn=prepare_child)
    return RankProcess(placement, popen)


def signal_rank_groups(ranks: list[RankProcess], sig: int):
    """Sends `sig` to each rank's whole process group, including children of exited ranks."""
    signal_groups([proc.popen.pid for proc in ranks], sig)


TERM_GRACE_S = 5.0  # stop_ranks' default grace: dslaunch's --term_grace, passed to every agent


def stop_ranks(ranks: list[RankProcess], grace_s: float, pump, hurried=lambda: False) -> None:
    """SIGTERM every group, wait up to `grace_s` (relaying output with `pump`) or until `hurried()`
    says so, then SIGKILL every group."""
    signal_rank_groups(ranks, signal.SIGTERM)
    signal_rank_groups(ranks, signal.SIGCONT)  # a SIGSTOPped rank must wake up to die
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not hurried():
        for proc in ranks:
            proc.poll()
        if all(proc.returncode is not None for proc in ranks):
            break
        pump(0.05)
    stubborn = [proc.rank for proc in ranks if proc.returncode is None]
    if stubborn and not hurried():  # what the user's ranks did with SIGTERM, and what the grace was
        print(f"dslaunch: rank(s) {', '.join(map(str, stubborn))} still running {grace_s:g} s after SIGTERM "
              "(--term_grace): SIGKILL", file=sys.stderr, flush=True)
    signal_rank_groups(ranks, signal.SIGKILL)
    for proc in ranks:
        proc.popen.wait()
        proc.exited_at = proc.exited_at or time.monotonic()
        proc.poll()
