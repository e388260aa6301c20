"""Where a ZeRO-Infinity rank's RSS goes, phase by phase (offload/host_heap.py's note).

    python benchmarks/infinity_rss_phases.py --params 2.5e8 --steps 2

bench_infinity.py's GPT and config (ZeRO-3, parameters and optimizer on NVMe, `swap_slots` 1) on 2
ranks; in each rank a thread samples the RSS and glibc's `mallinfo2` every 10 ms and keeps, per phase
(build, initialize, forward k, backward k, step k), the highest RSS with malloc's live bytes (in-use
heap plus mmapped blocks) and held bytes (arena plus mmapped) at that moment. RSS above live is what
the allocator keeps; live above `dstrain estimate`'s figure (bench_infinity.py prints it) is what the
estimate does not count. glibc only (ctypes' mallinfo2).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]


class PhasePeaks:
    """Per phase, the highest RSS seen and malloc's live and held bytes at that sample (module docstring)."""

    def __init__(self, every_s: float = 0.01):
        import psutil
        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallinfo2.restype = Mallinfo2
        self.proc, self.phase, self.peaks = psutil.Process(), "start", {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every_s,), daemon=True)
        self._thread.start()

    def _sample(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            rss, info = self.proc.memory_info().rss, self.libc.mallinfo2()
            peak = self.peaks.setdefault(self.phase, [0, 0, 0])
            if rss > peak[0]:
                peak[:] = [rss, info.uordblks + info.hblkhd, info.arena + info.hblkhd]

    def stop(self) -> dict:
        time.sleep(0.05)
        self._stop.set()
        self._thread.join()
        return self.peaks


def rank_main(rank: int, world: int, port: int, params: float, steps: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import psutil
    import torch.distributed as dist

    import engine
    from benchmarks.bench_infinity import _largest_group, ds_config, gpt_config, remote_device
    from examples.gpt import GPT, RandomTokens
    torch.set_num_threads(1)
    nvme = tempfile.mkdtemp(prefix="infinity-rss-")
    model_cfg = gpt_config(params, 64)
    cfg = ds_config(nvme, 1, _largest_group(model_cfg, world), int(10e6), int(20e6), 1.0, "nvme", "nvme", True, 1)
    dist.init_process_group("gloo")
    start = psutil.Process().memory_info().rss
    probe = PhasePeaks()
    probe.phase = "build"
    torch.manual_seed(0)
    with engine.zero.Init(remote_device=remote_device(cfg), config_dict_or_path=cfg):
        model = GPT(model_cfg)
    probe.phase = "initialize"
    eng, _, _, _ = engine.initialize(model=model, config=cfg)
    x, y = RandomTokens(1, model_cfg.seq_len, model_cfg.vocab_size, seed=rank)[:]
    for k in range(steps):
        probe.phase = f"forward {k}"
        loss = eng(x, y)
        probe.phase = f"backward {k}"
        eng.backward(loss)
        probe.phase = f"step {k}"
        eng.step()
    probe.phase = "end"
    peaks = probe.stop()
    Path(out, f"{rank}.json").write_text(json.dumps({"start": start, "peaks": peaks}))
    eng.destroy()
    os.rmdir(nvme)  # destroy() removed the job's swap directory inside it


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=2.5e8)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    params, steps = args.params, args.steps
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(2, port, params, steps, out), nprocs=2)
        for r in range(2):
            d = json.loads(Path(out, f"{r}.json").read_text())
            mib = 2**20
            print(f"rank {r}: start RSS {d['start'] / mib:.0f} MiB")
            for ph, (rss, live, held) in d["peaks"].items():
                print(f"  {ph:12s} peak RSS {rss / mib:7.0f} (+{(rss - d['start']) / mib:6.0f})  "
                      f"malloc live {live / mib:7.0f}  malloc held {held / mib:7.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
