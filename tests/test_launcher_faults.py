"""dslaunch under faults: a killed rank, a stopped (hung) rank, Ctrl-C, a killed launcher.

Each test starts a real job, waits until every rank trained a step, injects the fault, and checks
that the whole job is gone from the process table within the bound the issue sets.
"""
import os
import signal
import time

import psutil
import pytest

from launcher_scripts.harness import (RANK_WITH_CHILD, WORKER, free_port, kill_leftovers, live, processes_mentioning,
                                      rank_record, start_dslaunch, wait_for)

GONE_WITHIN_S = 10
HANG_S = 2


@pytest.fixture
def job(tmp_path):
    """Starts a 2-rank job that trains slowly until told otherwise; cleans up whatever remains."""
    out = str(tmp_path / "out")
    started = []

    def start(*extra_args, worker_args=(), ready="first_step"):
        proc = start_dslaunch("--nproc_per_node", "2", "--master_port", str(free_port()), *extra_args,
                              WORKER, "--out", out, "--steps", "100000", "--step_time", "0.05", *worker_args)
        started.append(proc)
        for rank in range(2):
            wait_for(lambda r=rank: os.path.exists(os.path.join(out, f"{ready}_rank{r}")), 60,
                     f"rank {rank}'s {ready}")
        return proc, [rank_record(out, rank)["pid"] for rank in range(2)]

    yield start, out
    for proc in started:
        if proc.poll() is None:
            proc.kill()
    kill_leftovers(out)


def wait_gone(proc, marker, timeout):
    stdout, stderr = proc.communicate(timeout=timeout)
    wait_for(lambda: not processes_mentioning(marker), 5, "every process of the job to be gone")
    return stdout, stderr


def test_kill_9_of_one_rank_stops_every_rank(job):
    start, out = job
    launcher, pids = start()
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    _, stderr = wait_gone(launcher, out, GONE_WITHIN_S)
    assert time.monotonic() - killed_at < GONE_WITHIN_S
    assert launcher.returncode == 128 + signal.SIGKILL
    assert ("dslaunch: job failed: rank 1 on host localhost (node 0, local rank 1) was killed by signal 9 "
            "(SIGKILL)") in stderr


def test_sigstop_of_one_rank_is_detected_as_a_hang_with_stacks(job):
    start, out = job
    # Stopped only after both ranks' first heartbeat: a rank stopped before any rank of its node beat
    # is start-up, which the hang clock does not cover (launcher/hang.py); under load that window was
    # wide enough for this test to stop rank 1 inside it and wait in vain.
    # HANG_S 2: 40 of the worker's 0.05 s steps, still far above a step's time on a loaded machine
    launcher, pids = start("--hang_timeout", str(HANG_S), worker_args=("--heartbeat",), ready="first_beat")
    os.kill(pids[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    _, stderr = wait_gone(launcher, out, HANG_S + GONE_WITHIN_S)
    assert time.monotonic() - stopped_at < HANG_S + GONE_WITHIN_S
    assert launcher.returncode == 124
    assert "hang detected on host localhost (node 0): no rank made progress for" in stderr
    for rank in range(2):  # faulthandler's dump, relayed with the rank prefix
        assert f"[rank{rank}]: " in stderr and "train_worker.py\", line" in stderr
    assert "most recent call first" in stderr


def test_sigint_to_dslaunch_leaves_no_process(job):
    start, out = job
    launcher, pids = start()
    agent = [p for p in processes_mentioning(out) if "launcher.agent" in " ".join(p.cmdline())]
    assert len(agent) == 1
    launcher.send_signal(signal.SIGINT)
    _, stderr = wait_gone(launcher, out, GONE_WITHIN_S)
    assert launcher.returncode == 128 + signal.SIGINT
    assert "dslaunch: stopped by SIGINT" in stderr
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in pids + [agent[0].pid])


@pytest.mark.parametrize("child_flags", [("--child_ignores_sigterm",), ()], ids=["child-ignores-term", "child"])
@pytest.mark.parametrize("gap_s", [0.0, 0.01])
def test_two_quick_signals_to_dslaunch_kill_every_rank_group_first(tmp_path, gap_s, child_flags):
    """Ctrl-C twice, or `timeout` signalling dslaunch and its group: each rank's children (its process
    group, where data-loader workers live) are dead by the time dslaunch exits, even a child that
    ignores SIGTERM."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    launcher = start_dslaunch("--nproc_per_node", "2", "--master_port", str(free_port()),
                              RANK_WITH_CHILD, out, *child_flags)
    try:
        for rank in range(2):
            wait_for(lambda r=rank: os.path.exists(os.path.join(out, f"pids_rank{r}")), 30, f"rank {rank}'s child")
        pids = [int(pid) for rank in range(2) for pid in open(os.path.join(out, f"pids_rank{rank}")).read().split()]
        launcher.send_signal(signal.SIGTERM)
        time.sleep(gap_s)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=GONE_WITHIN_S)
        assert launcher.returncode == 128 + signal.SIGTERM
        assert "dslaunch: stopped by SIGTERM" in stderr
        # killed before dslaunch exited; a moment more only for the kernel to reap them
        wait_for(lambda: not any(live(pid) for pid in pids), 1, "every rank and rank child to be gone")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=5)
        kill_leftovers(out)


def job_processes(launcher, out: str, nranks: int) -> list[psutil.Process]:
    """Every process under dslaunch once each rank's child is up: agent, dead man's switch, ranks,
    the ranks' children. psutil.Process remembers each start time, so a recycled pid is never killed."""
    for rank in range(nranks):
        wait_for(lambda r=rank: os.path.exists(os.path.join(out, f"pids_rank{r}")), 30, f"rank {rank}'s child")
    children = [int(open(os.path.join(out, f"pids_rank{rank}")).read().split()[1]) for rank in range(nranks)]
    found = psutil.Process(launcher.pid).children(recursive=True)
    assert set(children) <= {proc.pid for proc in found}
    assert any("launcher.deadman" in " ".join(proc.cmdline()) for proc in found)
    return found


def still_running(procs: list[psutil.Process]) -> list[str]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(" ".join(proc.cmdline())[:120])
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize("child_flags", [("--child_ignores_sigterm",), ()], ids=["child-ignores-term", "child"])
@pytest.mark.parametrize("victim", ["agent", "dslaunch"])
def test_a_launcher_killed_outright_takes_the_ranks_children_with_it(tmp_path, victim, child_flags):
    """SIGKILL of the agent (the ranks die by PDEATHSIG; their children only through the dead man's
    switch) or of dslaunch (the agents see the control connection close and stop the rank groups):
    nothing of the job survives, as torchrun's process-group kill and a job scheduler expect."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    launcher = start_dslaunch("--nproc_per_node", "2", "--master_port", str(free_port()),
                              RANK_WITH_CHILD, out, *child_flags)
    procs = []
    try:
        procs = job_processes(launcher, out, 2)
        agent = next(proc for proc in procs if "launcher.agent" in " ".join(proc.cmdline()))
        (agent if victim == "agent" else psutil.Process(launcher.pid)).kill()
        # killing an agent is immediate; a lost dslaunch means SIGTERM first, SIGKILL after the
        # agent's 5 s grace for a child that ignores SIGTERM
        bound = 5 + (5 if victim == "dslaunch" and child_flags else 0)
        deadline = time.monotonic() + bound
        while still_running(procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not still_running(procs), f"survived {bound} s after the {victim} was killed"
        if victim == "dslaunch":  # nor was anything of the job started after the snapshot (dslaunch is a zombie)
            assert not processes_mentioning(out), [" ".join(proc.cmdline()) for proc in processes_mentioning(out)]
    finally:
        for proc in procs:  # whatever the outcome, no orphan outlives the test
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate(timeout=10)
        kill_leftovers(out)


def test_term_grace_sets_the_time_from_sigterm_to_sigkill(tmp_path):
    """`dslaunch --term_grace S`: ranks that ignore SIGTERM are SIGKILLed S seconds after the stop, not
    after the default 5 s: no sooner (the deadline), and the agent says it waited S (an upper bound on
    wall time would be a timing assertion: under load the launcher's own exit can take seconds)."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    grace = 0.5
    launcher = start_dslaunch("--nproc_per_node", "2", "--master_port", str(free_port()), "--term_grace", str(grace),
                              RANK_WITH_CHILD, out, "--rank_ignores_sigterm")
    try:
        for rank in range(2):
            wait_for(lambda r=rank: os.path.exists(os.path.join(out, f"pids_rank{r}")), 30, f"rank {rank}'s child")
        ranks = [int(open(os.path.join(out, f"pids_rank{rank}")).read().split()[0]) for rank in range(2)]
        signalled_at = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=20)
        took = time.monotonic() - signalled_at
        assert launcher.returncode == 128 + signal.SIGTERM, stderr
        assert not any(live(pid) for pid in ranks)
        assert took >= grace, f"dslaunch took {took:.2f} s to stop ranks that ignore SIGTERM"  # the agent's SIGTERM follows ours
        assert "rank(s) 0, 1 still running 0.5 s after SIGTERM (--term_grace): SIGKILL" in stderr, stderr
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=5)
        kill_leftovers(out)
