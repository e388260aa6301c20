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
                        launch_file="/f", user_script="train.py", **kw)


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


def test_control_port_listens_only_where_the_agents_connect(tmp_path):
    from launcher.cli import build_parser, listen_for_agents, make_plan
    from launcher.errors import LaunchError
    (tmp_path / "hosts").write_text("w1 slots=1\nw2 slots=1\n")

    def plan(control_addr):
        args = build_parser().parse_args(["--hostfile", str(tmp_path / "hosts"), "--launcher", "ssh",
                                          "--control_addr", control_addr, "train.py"])
        return make_plan(args, {}, str(tmp_path))
    own = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
           if a.family == socket.AF_INET and not a.address.startswith("127.")]
    for address in ["127.0.0.1", *own[:1]]:  # a non-loopback one is what a multi-node job uses
        server = listen_for_agents(plan(address), "token")
        try:
            assert server._listener.getsockname()[0] == address  # not 0.0.0.0 (every interface)
        finally:
            server.close()
    foreign = next(a for a in ("198.51.100.7", "203.0.113.7", "192.0.2.7") if a not in own)  # documentation nets
    with pytest.raises(LaunchError, match=rf"cannot listen for the agents on '{foreign}': .*--control_addr"):
        listen_for_agents(plan(foreign), "token")


def control_port_of(out: str) -> int:
    (agent,) = [p for p in processes_mentioning(out) if "launcher.agent" in " ".join(p.cmdline())]
    argv = agent.cmdline()
    host, _, port = argv[argv.index("--control") + 1].rpartition(":")
    assert host == "127.0.0.1"
    return int(port)


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_strangers_on_the_control_port_cannot_stop_or_slow_a_job(tmp_path):
    from launcher.control import AUTH_TIMEOUT_S, MAX_PENDING
    out, stop = str(tmp_path / "out"), str(tmp_path / "stop")
    # runs until the attacks are over (the stop file), however long they take: not a fixed 400 steps
    launcher = start_dslaunch("--nproc_per_node", "2", "--master_port", str(free_port()), WORKER, "--out", out,
                              "--steps", "100000", "--step_time", "0.05", "--stop_file", stop)
    attackers = []
    try:
        wait_for(lambda: all(os.path.exists(os.path.join(out, f"first_step_rank{r}")) for r in range(2)), 60,
                 "both ranks' first step")
        port = control_port_of(out)
        (agent,) = [p for p in processes_mentioning(out) if "launcher.agent" in " ".join(p.cmdline())]
        launch_file = agent.cmdline()[agent.cmdline().index("--launch_file") + 1]
        wait_for(lambda: not os.path.exists(launch_file), 10, "the launch file to go once the agent said hello")
        (listener,) = [c for c in psutil.Process(launcher.pid).net_connections("tcp")
                       if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert listener.laddr.ip == "127.0.0.1"  # never every interface

        def connect(payload: bytes = b"") -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            try:
                sock.sendall(payload)
            except OSError:
                pass  # already dropped mid-send (the oversized one)
            attackers.append(sock)
            return sock

        idle = [connect() for _ in range(MAX_PENDING + 10)]  # more than may wait for a token
        bad = [connect(b"not json\n"), connect(b"[1,2]\n"), connect(b"\xff\xfe\n"),
               connect(b'{"type": "hello", "token": "guess", "node_rank": 0}\n'),
               connect(b"0" * 32 + b'\n{"type": "stop"}\n'), connect(b"x" * (4 << 20))]
        slow = connect(b"a")
        for sock in bad:
            assert closed_by_peer(sock, 5), sock
        assert closed_by_peer(idle[0], 5)  # the oldest waiting connection made room
        deadline = time.monotonic() + AUTH_TIMEOUT_S + 5
        while time.monotonic() < deadline and not closed_by_peer(slow, 0.3):
            try:
                slow.sendall(b"a")  # one byte at a time, never a newline
            except OSError:
                break
        assert time.monotonic() < deadline, "a slow connection was kept past the token timeout"
        assert launcher.poll() is None, "the job ended during the attacks"
        open(stop, "w").close()
        stdout, stderr = launcher.communicate(timeout=120)
        assert launcher.returncode == 0, stderr[-3000:]
        assert os.path.exists(os.path.join(out, "final_loss"))
        last = open(os.path.join(out, "stopped_at")).read()  # ended by the stop file, every step logged
        assert f"[rank1]: step {last} loss" in stdout and f"[rank0]: step {last} loss" in stdout
        drops = [line for line in stderr.splitlines() if line.startswith("dslaunch: dropped a control connection")]
        for why in ("a wrong token", "without a token line", "no token within",
                    f"more than {MAX_PENDING} connections"):
            assert any(why in line for line in drops), (why, drops)
        assert all("from 127.0.0.1:" in line for line in drops)
        assert "Traceback" not in stderr
    finally:
        for sock in attackers:
            sock.close()
        if launcher.poll() is None:
            launcher.kill()
        kill_leftovers(out)


SECRETS = {"HF_TOKEN": "hf_s3cr3t_from_env", "MLFLOW_TRACKING_PASSWORD": "mlflow-s3cr3t",
           "DSTRAIN_TEST_VALUE": "dstrain-s3cr3t"}
DSENV_SECRET = "wandb-s3cr3t-from-dsenv"
_TOKEN_WORD = re.compile(r"(^|\0)[0-9a-f]{32}($|\0)")


@pytest.mark.parametrize("runner", REMOTE_RUNNERS)
def test_no_secret_in_any_runner_command(tmp_path, runner):
    (tmp_path / "hosts").write_text("w1 slots=1\nw2 slots=1\n")
    (tmp_path / ".dsenv").write_text(f"WANDB_API_KEY={DSENV_SECRET}\n")
    result = run_dslaunch("--hostfile", str(tmp_path / "hosts"), "--launcher", runner, "--dry_run", "train.py",
                          cwd=str(tmp_path), env=launch_env(HOME=str(tmp_path), **SECRETS), timeout=30)
    assert result.returncode == 0, result.stderr
    for secret in [*SECRETS.values(), DSENV_SECRET]:
        assert secret not in result.stdout
    assert "--token" not in result.stdout and "--launch_file" in result.stdout


def test_no_secret_on_any_command_line_of_a_running_job(tmp_path):
    from launcher_scripts.harness import command_lines_until_exit
    (tmp_path / ".dsenv").write_text(f"WANDB_API_KEY={DSENV_SECRET}\n")
    out = str(tmp_path / "out")
    launcher = start_dslaunch("--nproc_per_node", "2", "--master_port", str(free_port()), WORKER, "--out", out,
                              "--steps", "40", "--step_time", "0.05", cwd=str(tmp_path),
                              env=launch_env(HOME=str(tmp_path), **SECRETS))
    try:
        seen, _, stderr = command_lines_until_exit(launcher, timeout=120)
    finally:
        kill_leftovers(out)
    assert launcher.returncode == 0, stderr[-3000:]
    job = [line for line in seen if out in line]
    assert any("launcher.agent" in line for line in job) and any("train_worker.py" in line for line in job)
    for line in seen:  # every process of the machine, sampled while the job ran
        for secret in [*SECRETS.values(), DSENV_SECRET]:
            assert secret not in line, line
    for line in job:  # (other people's jobs on this machine may run other code)
        assert not _TOKEN_WORD.search(line) and "\0--token\0" not in line, line
    from launcher_scripts.harness import rank_record
    assert rank_record(out, 1)["DSTRAIN_TEST_VALUE"] == SECRETS["DSTRAIN_TEST_VALUE"]  # still arrives


def test_launch_file_is_private(tmp_path):
    from launcher.handoff import read_launch_file, remove_launch_file, write_launch_file
    path = write_launch_file(str(tmp_path), "tok", {"HF_TOKEN": "x"})
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    assert read_launch_file(path) == ("tok", {"HF_TOKEN": "x"})
    remove_launch_file(path)
    assert not os.path.exists(os.path.dirname(path))


def run_dslaunch_with_planted_pid_file(tmp_path, plant, *args):
    """dslaunch in a process that first plants /tmp/<its own pid>.dslaunch with `plant(path)`, as
    another user could (the name is predictable)."""
    import subprocess
    import sys
    code = ("import os, sys\n"
            "from launcher.cli import main\n"
            "path = f'/tmp/{os.getpid()}.dslaunch'\n"
            f"{plant}\n"
            "try:\n"
            "    code = main(sys.argv[1:])\n"
            "    print('pid file after:', os.path.lexists(path))\n"
            "finally:\n"
            "    if os.path.lexists(path):\n"
            "        os.remove(path)\n"
            "sys.exit(code)\n")
    return subprocess.run([sys.executable, "-c", code, *args], env=launch_env(), cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=90)


def test_save_pid_never_writes_through_a_planted_link(tmp_path):
    target = tmp_path / "victim"
    result = run_dslaunch_with_planted_pid_file(tmp_path, f"os.symlink({str(target)!r}, path)",
                                                "--save_pid", "--nproc_per_node", "1", "train.py")
    one_line_error(result, "--save_pid: /tmp/", ".dslaunch already exists")
    assert not target.exists()


def test_save_pid_writes_and_removes_its_own_file(tmp_path):
    seen = tmp_path / "seen"
    script = tmp_path / "show_pid_file.py"
    script.write_text("import os, psutil\n"  # the rank's parent is the agent, whose parent is dslaunch
                      "pid = psutil.Process(os.getppid()).ppid()\n"
                      f"open({str(seen)!r}, 'w').write(f'{{pid}} ' + open(f'/tmp/{{pid}}.dslaunch').read())\n")
    result = run_dslaunch_with_planted_pid_file(tmp_path, "pass", "--save_pid", "--nproc_per_node", "1",
                                                "--master_port", str(free_port()), str(script))
    assert result.returncode == 0, result.stderr
    assert "pid file after: False" in result.stdout  # removed at the end
    pid, written = seen.read_text().split()
    assert pid == written  # it existed while the job ran, holding dslaunch's pid


def test_world_writable_dsenv_is_refused(tmp_path):
    dsenv = tmp_path / ".dsenv"
    dsenv.write_text("LD_PRELOAD=/tmp/evil.so\n")
    os.chmod(dsenv, 0o666)  # anyone could have put LD_PRELOAD there
    result = run_dslaunch("--dry_run", "train.py", cwd=str(tmp_path), env=launch_env(HOME=str(tmp_path)), timeout=30)
    one_line_error(result, f"{dsenv}: owned by uid", "mode 666", "chmod o-w")
    os.chmod(dsenv, 0o644)
    assert run_dslaunch("--dry_run", "train.py", cwd=str(tmp_path), env=launch_env(HOME=str(tmp_path)),
                        timeout=30).returncode == 0


def test_a_huge_output_line_still_gives_the_failure_report(tmp_path):
    """Control messages are bounded (control.MAX_MESSAGE); the failure report quotes the failing
    rank's last lines, so the agent clips them rather than lose the report."""
    script = tmp_path / "shout_and_fail.py"
    script.write_text("import sys\nprint('x' * 3_000_000, flush=True)\nsys.exit(3)\n")
    result = run_dslaunch("--nproc_per_node", "1", "--master_port", str(free_port()), str(script),
                          cwd=str(tmp_path), timeout=60)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "dslaunch: job failed: rank 0 on host localhost (node 0, local rank 0) exited with code 3" in result.stderr
