"""dslaunch against an attacker on a shared cluster (issue 16): hostile host names, connections to the
control port, secrets on command lines, the pid file.

Every hostile input is tried as an attacker would: through the real `dslaunch` command line, in a
fresh working directory whose listing shows whether an injected `touch` ran.
"""
import os
import re
import shlex
import socket
import time

import psutil
import pytest

from launcher.runners import AgentOptions, runner_processes, ssh_argv
from launcher.world import WorldInfo
from launcher_scripts.harness import (WORKER, free_port, kill_leftovers, launch_env, processes_mentioning,
                                      run_dslaunch, start_dslaunch, wait_for)

# Each would run `touch x` (or add a node) if it reached ssh, a shell or a host list as it stands.
HOSTILE_HOSTS = ["-oProxyCommand=touch${IFS}x", "a,b", "w1;touch${IFS}x", "$(touch${IFS}x)", "`touch${IFS}x`",
                 "w[1-3]", "root@w1", "w1=2", "w1|touch${IFS}x", "%h"]
REMOTE_RUNNERS = ["ssh", "pdsh", "slurm", "openmpi"]


def one_line_error(result, *expected: str):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dslaunch: error: "), result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("runner", REMOTE_RUNNERS)
@pytest.mark.parametrize("host", HOSTILE_HOSTS)
def test_hostile_hostfile_line_is_refused_by_every_runner(tmp_path, runner, host):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"good-1 slots=1\n{host} slots=1\n")
    for dry_run in (["--dry_run"], []) if runner in ("ssh", "pdsh") else (["--dry_run"],):
        # Without --dry_run, ssh and pdsh runs begin with the ssh pre-flight check of every host.
        result = run_dslaunch("--hostfile", str(hostfile), "--launcher", runner, *dry_run, "train.py",
                              cwd=str(tmp_path), timeout=30)
        one_line_error(result, f"{hostfile}:2: {host!r} is not a host name or IP address")
        assert sorted(os.listdir(tmp_path)) == ["hosts"]  # no `x`: nothing ran


@pytest.mark.parametrize("flag", ["--include", "--exclude", "--master_addr", "--control_addr"])
def test_hostile_host_flags_are_refused(tmp_path, flag):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("good-1 slots=1\ngood-2 slots=1\n")
    for host in ("-oProxyCommand=touch${IFS}x", "good-1,good-2"):
        result = run_dslaunch("--hostfile", str(hostfile), "--launcher", "ssh", f"{flag}={host}", "train.py",
                              cwd=str(tmp_path), timeout=30)
        one_line_error(result, f"{flag}", f"{host!r} is not a host name or IP address")
        assert sorted(os.listdir(tmp_path)) == ["hosts"]


def test_plain_names_and_addresses_are_accepted():
    from launcher.hostfile import host_problem
    for host in ("worker-1", "node_07", "gpu12.cluster.example.org", "10.0.0.7", "fe80::1", "localhost"):
        assert host_problem(host) is None, host


def options(world, **kw):
    return AgentOptions(world=world, master_addr="w1", master_port=29500, control="10.0.0.9:4000",
                        token="t", user_script="train.py", **kw)


def test_every_runner_passes_hosts_where_they_cannot_be_options():
    world = WorldInfo.from_slots({"w1": ("0",), "w2": ("0",)})
    ssh = runner_processes("ssh", options(world), {}, "/repo", launcher_args="-F cfg")
    for process, host in zip(ssh, world.hosts):
        assert process.argv[-3:-1] == ["--", host]
    assert ssh_argv("w2", 22, ["-F", "cfg"], "true")[-3:] == ["--", "w2", "true"]  # the pre-flight check
    (pdsh,) = runner_processes("pdsh", options(world), {}, "/repo")
    assert pdsh.argv[pdsh.argv.index("-w") + 1] == "w1,w2"
    (srun,) = runner_processes("slurm", options(world), {}, "/repo")
    assert "--nodelist=w1,w2" in srun.argv
    (mpi,) = runner_processes("openmpi", options(world), {}, "/repo")
    assert mpi.argv[mpi.argv.index("--host") + 1] == "w1:1,w2:1"
    hostile = WorldInfo.from_slots({"w1": ("0",), "-oProxyCommand=touch x": ("0",)})
    for runner in REMOTE_RUNNERS:  # a caller that skipped the hostfile's checks is refused too
        with pytest.raises(ValueError, match="refusing to start agents"):
            runner_processes(runner, options(hostile), {}, "/repo")
