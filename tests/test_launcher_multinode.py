"""dslaunch across two (simulated) nodes with real ssh, pdsh and mpirun.

Needs root (network namespaces) and Debian's openssh-server, pdsh and openmpi-bin, which the
session fixture installs with apt-get when they are missing.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from launcher_scripts.harness import (WORKER, command_lines_until_exit, dslaunch_argv, free_port, kill_leftovers,
                                      launch_env, processes_mentioning, rank_record, run_dslaunch, wait_for)
from launcher_scripts.netns_cluster import INTERFACE, Cluster, install_missing_packages

pytestmark = pytest.mark.slow
# steps of the jobs that run to their end: the agents, sampled for their command lines, live from before
# the ranks' torch import to the end (seconds); the steps only have to cross both nodes
STEPS = 10


@pytest.fixture(scope="session")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("network namespaces for the two simulated nodes need root")
    reason = install_missing_packages()
    if reason:
        pytest.skip(reason)
    nodes = Cluster()
    try:
        nodes.create()
    except (OSError, subprocess.SubprocessError, RuntimeError) as err:
        nodes.destroy()
        pytest.skip(f"cannot create network namespaces with sshd: {err}")
    try:
        yield nodes
    finally:
        nodes.destroy()


def check_four_ranks_on_two_nodes(cluster, out):
    for rank in range(4):
        seen = rank_record(out, rank)
        assert (seen["RANK"], seen["WORLD_SIZE"], seen["LOCAL_WORLD_SIZE"]) == (str(rank), "4", "2")
        assert (seen["NODE_RANK"], seen["LOCAL_RANK"]) == (str(rank // 2), str(rank % 2))
        assert seen["MASTER_ADDR"] == cluster.hosts[0]
    assert os.path.exists(os.path.join(out, "final_loss"))


@pytest.mark.parametrize("runner", ["ssh", "pdsh"])
def test_runner_trains_four_ranks_across_two_nodes_and_shows_no_secret(cluster, tmp_path, runner):
    """One job per runner (a job costs two nodes' worth of torch imports): the ranks see the launch
    environment; hostile .dsenv values and arguments arrive literally, run nothing; and ssh, the remote
    shell and the agents, which run for the whole job, show no secret in `ps`."""
    secrets = {"HF_TOKEN": "hf-s3cr3t-multinode", "DSTRAIN_TEST_VALUE": "dstrain-s3cr3t-multinode"}
    nasty_value = "$(touch pwned1) `touch pwned2`"
    (tmp_path / ".dsenv").write_text(f"WANDB_API_KEY=wandb-s3cr3t-multinode\nDSTRAIN_TEST_DSENV={nasty_value}\n")
    nasty = ["; touch pwned3 #", "$(touch pwned4)", "50%"]
    out = str(tmp_path / "out")
    env = launch_env(GLOO_SOCKET_IFNAME=INTERFACE, PDSH_SSH_ARGS_APPEND=f"-F {cluster.ssh_config}", **secrets)
    argv = cluster.in_first_node(*dslaunch_argv(
        "--hostfile", cluster.hostfile(), "--master_port", str(free_port()), "--launcher", runner,
        "--launcher_args", f"-F {cluster.ssh_config}" if runner == "ssh" else "", WORKER, "--out", out,
        "--steps", str(STEPS), "--step_time", "0.05", "--echo", *nasty))
    launcher = subprocess.Popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        seen, stdout, stderr = command_lines_until_exit(launcher, timeout=150)
    finally:
        kill_leftovers(str(tmp_path))
    assert launcher.returncode == 0, stderr[-4000:]
    check_four_ranks_on_two_nodes(cluster, out)
    for rank in range(4):
        record = rank_record(out, rank)
        assert record["echo"] == nasty
        assert record["DSTRAIN_TEST_DSENV"] == nasty_value
        assert record["DSTRAIN_TEST_VALUE"] == secrets["DSTRAIN_TEST_VALUE"]  # via the launch file
    assert not any(name.startswith("pwned") for name in os.listdir(tmp_path))
    assert f"[rank3@{cluster.hosts[1]}]: step {STEPS - 1} loss" in stdout
    agents = [line for line in seen if line.startswith(f"{sys.executable}\0-u\0-m\0launcher.agent\0") and out in line]
    assert len(agents) >= 2, agents  # both nodes' agents were sampled
    for line in seen:
        for secret in [*secrets.values(), "wandb-s3cr3t-multinode"]:
            assert secret not in line, line
        assert out not in line or "--token" not in line, line  # other jobs on this machine may run other code


def test_a_rank_killed_on_the_second_node_stops_both_nodes(cluster, tmp_path):
    out = str(tmp_path / "out")
    env = launch_env(GLOO_SOCKET_IFNAME=INTERFACE)
    argv = cluster.in_first_node(*dslaunch_argv(
        "--hostfile", cluster.hostfile(), "--master_port", str(free_port()), "--launcher", "ssh",
        "--launcher_args", f"-F {cluster.ssh_config}", WORKER, "--out", out, "--steps", "100000",
        "--step_time", "0.05"))
    launcher = subprocess.Popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        for rank in range(4):
            wait_for(lambda r=rank: os.path.exists(os.path.join(out, f"first_step_rank{r}")), 90, f"rank {rank}")
        killed_at = time.monotonic()
        os.kill(rank_record(out, 3)["pid"], signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=10)
        wait_for(lambda: not processes_mentioning(out), 10 - (time.monotonic() - killed_at), "all ranks gone")
        assert launcher.returncode == 128 + signal.SIGKILL
        assert (f"rank 3 on host {cluster.hosts[1]} (node 1, local rank 1) was killed by signal 9 (SIGKILL)"
                in stderr)
    finally:
        launcher.kill()
        kill_leftovers(out)


def test_openmpi_runner_with_real_mpirun_on_localhost(tmp_path):
    if os.geteuid() == 0 and install_missing_packages():
        pytest.skip("openmpi-bin is not installed and cannot be installed")
    out = str(tmp_path / "out")
    result = run_dslaunch("--launcher", "openmpi", "--nproc_per_node", "2", "--master_port", str(free_port()),
                          WORKER, "--out", out, "--steps", "2", timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(2):
        seen = rank_record(out, rank)
        assert (seen["RANK"], seen["LOCAL_RANK"], seen["WORLD_SIZE"]) == (str(rank), str(rank), "2")
