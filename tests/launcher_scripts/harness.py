"""Helpers for the launcher tests: run dslaunch as a real process, find leftover processes."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "launcher_scripts", "train_worker.py")
RANK_WITH_CHILD = os.path.join(REPO, "tests", "launcher_scripts", "rank_with_child.py")


# The kernel's range for bind(0) and outgoing connections, per network namespace.
EPHEMERAL_PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
# Ports free_port() handed out, bound for the rest of the test process: a released port can be taken.
_HELD_PORTS: list[socket.socket] = []


def free_port() -> int:
    """A port on 127.0.0.1 for a job's rendezvous that no other process can take before rank 0 binds it.

    A port found by binding port 0 and closing the socket is free only until someone else binds it (a
    test that bound it first made rank 0's TCPStore fail with EADDRINUSE), and the kernel hands that
    range to every bind(0) on the machine (gloo's listeners, dslaunch's control port, other test runs)
    and to outgoing connections. So the port is drawn above torch's default 29500 and outside
    ip_local_port_range, where the kernel hands nothing out; where that range covers all of 30000-65535
    (1024-65535, as some CI boxes set it), from inside it: a held port is safe there too (bind(0), with
    or without SO_REUSEADDR, and connect() skipped it, checked with the range exhausted). It stays
    bound: first without SO_REUSEADDR (that bind fails while anyone has the port, another run's hold
    included), then with it, so that the job's store (libuv and c10d both set SO_REUSEADDR) can bind
    beside it while a bind without SO_REUSEADDR fails; `release_port` ends the hold early."""
    with open(EPHEMERAL_PORT_RANGE) as handle:
        low, high = (int(bound) for bound in handle.read().split())
    candidates = [port for port in range(30000, 65536) if not low <= port <= high] or list(range(30000, 65536))
    for port in random.Random().sample(candidates, min(len(candidates), 100)):  # not the tests' seeded draws
        held = socket.socket()
        try:
            held.bind(("127.0.0.1", port))
        except OSError:
            held.close()
            continue
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _HELD_PORTS.append(held)
        return port
    raise RuntimeError(f"no free port on 127.0.0.1 in 100 tries of 30000-65535 (ip_local_port_range {low}-{high}): "
                       "end the processes that hold them, or narrow net.ipv4.ip_local_port_range")


def release_port(port: int) -> None:
    """Closes free_port's hold on `port`, for a caller that runs many jobs (run_distributed): its ports
    would otherwise stay bound for the whole test session, hundreds of them."""
    for held in [held for held in _HELD_PORTS if held.getsockname()[1] == port]:
        _HELD_PORTS.remove(held)
        held.close()


def launch_env(**extra: str) -> dict[str, str]:
    """dslaunch's environment; CUDA_VISIBLE_DEVICES only when a test sets it (a GPU machine's own
    setting would limit the ranks a test may start)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHONPATH=REPO, NO_COLOR="1")
    env.update(extra)
    return env


def dslaunch_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", *args]


def run_dslaunch(*args: str, timeout: float = 60, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Runs dslaunch to completion; a hang fails the test after `timeout` seconds."""
    return subprocess.run(dslaunch_argv(*args), env=env or launch_env(), cwd=cwd or REPO, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_dslaunch(*args: str, env=None, cwd=None) -> subprocess.Popen:
    return subprocess.Popen(dslaunch_argv(*args), env=env or launch_env(), cwd=cwd or REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def rank_record(out_dir: str, rank: int, attempt: int = 0) -> dict:
    with open(os.path.join(out_dir, f"env_rank{rank}_attempt{attempt}.json")) as handle:
        return json.load(handle)


def live(pid: int) -> bool:
    """Running and not a zombie (a killed process its parent has not reaped yet counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def processes_mentioning(marker: str) -> list[psutil.Process]:
    """Live processes whose command line contains `marker` (a test's unique directory)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def kill_leftovers(marker: str):
    for proc in processes_mentioning(marker):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def command_lines_until_exit(popen: subprocess.Popen, timeout: float) -> tuple[set[str], str, str]:
    """Every command line seen on this machine (all processes, sampled) while `popen` runs; then its
    stdout and stderr. The pipes are drained by threads so that a chatty job cannot block on them."""
    import threading
    outputs = {}

    def drain(name, stream):
        outputs[name] = stream.read()

    readers = [threading.Thread(target=drain, args=(name, stream), daemon=True)
               for name, stream in (("out", popen.stdout), ("err", popen.stderr))]
    for reader in readers:
        reader.start()
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while popen.poll() is None:
        if time.monotonic() > deadline:
            popen.kill()
            raise AssertionError(f"the job did not finish within {timeout} s")
        for proc in psutil.process_iter(["cmdline"]):
            seen.add("\0".join(proc.info["cmdline"] or []))
        time.sleep(0.02)
    for reader in readers:
        reader.join(timeout=10)
    return seen, outputs.get("out", ""), outputs.get("err", "")
