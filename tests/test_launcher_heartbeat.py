"""engine.heartbeat: the engine-side half of dslaunch's hang detection."""
import subprocess
import sys
from datetime import timedelta

from torch.distributed import TCPStore

from engine import heartbeat
from launcher_scripts.harness import REPO


def test_beat_is_a_no_op_without_a_launcher(monkeypatch):
    monkeypatch.delenv("DSTRAIN_HEARTBEAT_ADDR", raising=False)
    heartbeat.reset()
    heartbeat.beat(1)
    assert heartbeat._state["store"] is None and heartbeat._state["disabled"]
    heartbeat.reset()


def test_beat_sets_a_changing_key_in_the_agents_store(monkeypatch):
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    monkeypatch.setenv("DSTRAIN_HEARTBEAT_ADDR", f"127.0.0.1:{store.port}")
    monkeypatch.setenv("RANK", "3")
    heartbeat.reset()
    heartbeat.beat(7)
    first = store.get("heartbeat/3")
    heartbeat.beat(7)  # same step again still counts as progress
    assert first.startswith(b"7:") and store.get("heartbeat/3") != first
    heartbeat.reset()


def test_sigusr1_dumps_the_stack_without_killing():
    code = ("import os, signal, sys; sys.path.insert(0, %r)\n"
            "from engine import heartbeat\n"
            "assert heartbeat.install_stack_dump()\n"
            "def waiting_here():\n    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "waiting_here(); print('alive')\n") % REPO
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "alive" in result.stdout
    assert "waiting_here" in result.stderr
