"""dslaunch --max_restarts with the engine's auto_resume: a job that loses a rank to kill -9 restarts,
continues from its latest checkpoint and ends exactly where an uninterrupted run ends."""
from __future__ import annotations

import json
import os

from launcher_scripts.harness import REPO, free_port, run_dslaunch
from tests.harness import run_distributed

SCRIPT = os.path.join(REPO, "tests", "launcher_scripts", "train_resumable.py")


def _run(tmp_path, name: str, *extra: str, crash_at: int = 0):
    out = tmp_path / f"{name}.json"
    result = run_dslaunch("--nproc_per_node", "2", "--master_port", str(free_port()), *extra, SCRIPT,
                          "--ckpt", str(tmp_path / f"ckpt-{name}"), "--out", str(out), "--steps", "8",
                          "--crash_at", str(crash_at), timeout=240)
    return result, (json.loads(out.read_text()) if out.exists() else None)


def _uninterrupted(ckpt: str, out: str) -> None:
    """The same script's main() in a 2-rank harness world (forks of a forkserver that imported torch and the
    engine): the uninterrupted reference without a launch of its own. It ends by destroying the process
    group, which the harness does after it here."""
    import sys

    import torch.distributed as dist

    from launcher_scripts.train_resumable import main
    sys.argv = [SCRIPT, "--ckpt", ckpt, "--out", out, "--steps", "8", "--crash_at", "0"]
    destroy, dist.destroy_process_group = dist.destroy_process_group, lambda *args, **kwargs: None
    try:
        main()
    finally:
        dist.destroy_process_group = destroy


def test_restart_resumes_from_checkpoint_and_matches_uninterrupted_run(tmp_path):
    run_distributed(_uninterrupted, 2, args=(str(tmp_path / "ckpt-plain"), str(tmp_path / "plain.json")), timeout=240)
    reference = json.loads((tmp_path / "plain.json").read_text())
    assert reference["restarts"] == "0"
    crashed, resumed = _run(tmp_path, "crashed", "--max_restarts", "1", crash_at=5)
    assert crashed.returncode == 0, crashed.stderr[-2000:]
    assert resumed["restarts"] == "1"  # the job really died once and came back
    # ... because of the kill, a failure of the job (without --max_restarts it ends the job: test_launcher_faults)
    assert "rank 1 on host localhost (node 0, local rank 1) was killed by signal 9 (SIGKILL)" in crashed.stderr
    assert "restarting the whole job (restart 1 of 1)" in crashed.stderr
    assert (resumed["loss"], resumed["params"]) == (reference["loss"], reference["params"])
    # The restart resumed from step 4 (saved every 2 steps), not from scratch.
    assert "global_step4" in os.listdir(tmp_path / "ckpt-crashed")
