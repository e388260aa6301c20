"""What posting one pipeline boundary message costs the posting thread on gloo: the work that the
measured bubble of a pipeline stage counts and the unit-cost bubble formula does not
(docs/parallelism.md, the measured bubble). Three routes: torch's `batch_isend_irecv` (its mixed
posts), the lone `dist.isend`/`dist.irecv` (its homogeneous ones), and the process group's own
`send`/`recv` (no Python wrapper), each with the peer's side posted first or not.

    python benchmarks/bench_p2p_posts.py --rows 256 --repeats 40

Two ranks, 1 thread each, gloo over loopback, one fp32 tensor of rows × 512 (the pipeline benchmark's
boundary at `--micro-size rows`). Per case, the median time the post call itself takes on the posting
rank (not its wait), over `--repeats` posts after 3 warm-up ones, each after a barrier, the peer's post
delayed by 5 ms where it comes second. A send that finds the receive posted writes the data into the
socket in the posting thread (gloo's tcp pair): "send second" less "send first" is that copy.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import run_distributed  # noqa: E402

ROUTES = ("batch_isend_irecv", "isend/irecv", "group send/recv")


def _post(route: str, kind: str, tensor, peer: int):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group
    if route == "batch_isend_irecv":
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer)])
    if route == "isend/irecv":
        return [(dist.isend if kind == "send" else dist.irecv)(tensor, peer)]
    group = _get_default_group()
    return [group.send([tensor], peer, 0) if kind == "send" else group.recv([tensor], peer, 0)]


def _measure(rows: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank = dist.get_rank()
    tensor = torch.randn(rows, 512) if rank == 0 else torch.empty(rows, 512)
    out: dict = {}
    for route in ROUTES:
        for kind in ("send", "recv"):
            for first in (True, False):  # the measured side posts first, or after the peer's post
                timed_rank = 0 if kind == "send" else 1
                samples = []
                for i in range(repeats + 3):
                    dist.barrier()
                    mine = rank == timed_rank
                    if mine != first:
                        time.sleep(0.005)
                    start = time.perf_counter()
                    works = _post(route, "send" if rank == 0 else "recv", tensor, 1 - rank)
                    took = time.perf_counter() - start
                    for work in works:
                        work.wait()
                    if mine and i >= 3:
                        samples.append(took * 1e3)
                if rank == timed_rank:
                    out[(route, kind, "first" if first else "second")] = statistics.median(samples)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    ranks = run_distributed(_measure, world_size=2, args=(args.rows, args.repeats), timeout=600)
    merged = {**ranks[0], **ranks[1]}
    print(f"# gloo, {args.rows} x 512 fp32 ({args.rows * 512 * 4 // 1024} KB); ms per post call, median of {args.repeats}")
    print(f"{'route':20s} {'send first':>11s} {'send second':>12s} {'recv first':>11s} {'recv second':>12s}")
    for route in ROUTES:
        cells = [merged[(route, kind, order)] for kind in ("send", "recv") for order in ("first", "second")]
        print(f"{route:20s} " + " ".join(f"{c:11.3f}" for c in cells))


if __name__ == "__main__":
    main()
