"""dslaunch and a rank's child that left the rank's process group (`setsid`, `start_new_session=True`,
as a daemon or a badly behaved helper does): the group kill cannot reach it, so the agent, as its
subreaper, kills it at exit, whether the job ended normally, a rank failed, or dslaunch was stopped;
and one that exits while the job runs is collected then, not left a zombie under the agent until the
job ends. (Not covered: the agent SIGKILLed outright, launcher/deadman.py's note.)"""
import os
import signal

import pytest

from launcher_scripts.harness import REPO, RANK_WITH_CHILD, free_port, kill_leftovers, live, start_dslaunch, wait_for

@pytest.mark.parametrize("how", ["ranks-exit-0", "stopped-by-sigterm"])
def test_a_child_in_its_own_session_does_not_outlive_the_job(tmp_path, how):
    out = str(tmp_path / "out")
    os.makedirs(out)
    flags = ("--child_new_session", "--rank_exits") if how == "ranks-exit-0" else ("--child_new_session",)
    launcher = start_dslaunch("--nproc_per_node", "2", "--master_port", str(free_port()), RANK_WITH_CHILD, out,
                              *flags)
    try:
        for rank in range(2):
            wait_for(lambda r=rank: os.path.exists(os.path.join(out, f"pids_rank{r}")), 30, f"rank {rank}'s child")
        children = [int(open(os.path.join(out, f"pids_rank{rank}")).read().split()[1]) for rank in range(2)]
        assert all(os.getsid(pid) == pid for pid in children)  # each left its rank's session and group
        if how == "stopped-by-sigterm":
            launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=20)
        assert launcher.returncode == (0 if how == "ranks-exit-0" else 128 + signal.SIGTERM)
        # killed and reaped before the agent exited; a moment only for init to reap a zombie
        wait_for(lambda: not any(live(pid) for pid in children), 1, "the ranks' own-session children to be gone")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=5)
        kill_leftovers(out)


@pytest.mark.parametrize("switch", ["running", "killed"])
def test_orphans_that_exit_while_the_job_runs_are_collected(tmp_path, switch):
    """`killed`: the dead man's switch, the agent's oldest child, died first: its zombie, first in the
    agent's list of children, must not stop the orphans behind it from being collected."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    script = os.path.join(REPO, "tests", "launcher_scripts", "rank_with_orphans.py")
    flags = ("--kill_switch",) if switch == "killed" else ()
    launcher = start_dslaunch("--nproc_per_node", "1", "--master_port", str(free_port()), script, out, *flags)
    try:
        stdout, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, stdout + stderr
        adopted, zombies = map(int, open(os.path.join(out, "orphans_rank0")).read().split())
        assert adopted == 3  # the premise: the agent became their parent when the middle process exited
        assert zombies == 0  # collected while the rank still ran
        if switch == "killed":
            assert "the dead man's switch exited" in stderr, stderr
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=5)
        kill_leftovers(out)
