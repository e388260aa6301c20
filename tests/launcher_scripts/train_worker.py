"""A tiny data-parallel training job over gloo, used by the launcher tests and benchmark.

Usage: python train_worker.py --out DIR [--steps N] [--step_time S] [--fail_rank R --fail_step K
       --fail_attempts A] [--stop_file PATH] [--heartbeat] [--echo ARG ...]

Each rank writes DIR/env_rank<R>_attempt<A>.json (its launcher environment and argv), DIR/
first_step_rank<R> (time.time() at its first step), DIR/failed_at (when it fails) and, on rank 0, DIR/final_loss. With --fail_rank
the rank exits with code 3 at --fail_step while DSTRAIN_RESTART_COUNT < --fail_attempts (so a job
with restarts fails once and then succeeds); DIR/attempts counts the starts. With --stop_file the job
ends after the first step at which PATH exists (rank 0 looks, every rank follows), and rank 0 writes that
step to DIR/stopped_at: a test ends a long job as soon as it is done with it, not after a fixed time.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "DSTRAIN_RESTART_COUNT", "DSTRAIN_HEARTBEAT_ADDR",
               "DSTRAIN_TEST_VALUE", "DSTRAIN_TEST_DSENV", "OMP_NUM_THREADS", "PYTHONPATH")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step_time", type=float, default=0.0)
    parser.add_argument("--fail_rank", type=int, default=-1)
    parser.add_argument("--fail_step", type=int, default=0)
    parser.add_argument("--fail_attempts", type=int, default=1)
    parser.add_argument("--stop_file", default=None)
    parser.add_argument("--heartbeat", action="store_true")
    parser.add_argument("--echo", nargs="*", default=[])
    return parser.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(1)
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("DSTRAIN_RESTART_COUNT", "0"))
    os.makedirs(args.out, exist_ok=True)
    record = {k: os.environ.get(k) for k in LAUNCH_VARS}
    record.update(argv=sys.argv[1:], echo=args.echo, pid=os.getpid(), affinity=sorted(os.sched_getaffinity(0)))
    with open(os.path.join(args.out, f"env_rank{rank}_attempt{attempt}.json"), "w") as handle:
        json.dump(record, handle)
    if rank == 0:
        with open(os.path.join(args.out, "attempts"), "a") as handle:
            handle.write(f"{attempt}\n")
    if args.heartbeat:
        from engine import heartbeat
        heartbeat.install_stack_dump()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    target = data.sum(dim=1, keepdim=True)
    for step in range(args.steps):
        if step == 0:
            with open(os.path.join(args.out, f"first_step_rank{rank}"), "w") as handle:
                handle.write(repr(time.time()))
        if rank == args.fail_rank and step == args.fail_step and attempt < args.fail_attempts:
            print(f"rank {rank} failing on purpose at step {step}", flush=True)
            with open(os.path.join(args.out, "failed_at"), "w") as handle:
                handle.write(repr(time.time()))
            sys.exit(3)
        shard = data[rank::dist.get_world_size()]
        loss = torch.nn.functional.mse_loss(model(shard), target[rank::dist.get_world_size()])
        model.zero_grad()
        loss.backward()
        # SGD by hand: torch.optim's first optimizer imports torch._dynamo, about 2 s of CPU per rank (as
        # much again as `import torch`), in each of the launcher tests' ~40 rank starts
        with torch.no_grad():
            for param in model.parameters():
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
                param -= 0.1 * param.grad
        if args.heartbeat:
            from engine import heartbeat
            heartbeat.beat(step)
            if step == 0:  # the agent's hang clock starts at a node's first heartbeat (launcher/hang.py)
                open(os.path.join(args.out, f"first_beat_rank{rank}"), "w").close()
        print(f"step {step} loss {loss.item():.6f}", flush=True)
        time.sleep(args.step_time)
        if args.stop_file is not None and _stop_here(args.stop_file, rank):
            if rank == 0:
                with open(os.path.join(args.out, "stopped_at"), "w") as handle:
                    handle.write(str(step))
            break
    if rank == 0:
        with open(os.path.join(args.out, "final_loss"), "w") as handle:
            handle.write(repr(loss.item()))
    dist.destroy_process_group()
    # torch's own exit race: a gloo worker thread still dropping its last collective's tensor while the
    # interpreter finalizes aborts the process ("terminate called without an active exception", rank 1
    # of a 2-rank launch in one CI run of ~40 of this worker's launches); engine/teardown.py's note. A
    # job built on the engine gets this wait from init_distributed's atexit handler; this plain one asks.
    from engine.teardown import release_collective_threads
    release_collective_threads()


def _stop_here(stop_file: str, rank: int) -> bool:
    """Rank 0's look at the stop file, the same answer on every rank (they leave the loop together)."""
    stop = torch.tensor([float(rank == 0 and os.path.exists(stop_file))])
    dist.broadcast(stop, 0)
    return bool(stop.item())


if __name__ == "__main__":
    main()
