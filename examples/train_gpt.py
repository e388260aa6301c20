"""Demo: train a small byte-level GPT on the Python standard library's source with dstrain.

    dslaunch --num_gpus 2 examples/train_gpt.py --deepspeed_config sample_configs/ddp.json

Every strategy is a config swap (sample_configs/*.json); the script is the same. Runs as one process
too (`python examples/train_gpt.py`), or under torchrun/srun.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import engine  # noqa: E402
from engine.display import TrainingProgress, print_summary  # noqa: E402
from engine.monitor import rss_mb  # noqa: E402
from examples.gpt import GPT, ByteCorpus, GPTConfig, uniform_loss  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "sample_configs" / "ddp.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps to run")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: cores / local ranks)")
    p.add_argument("--out", default="runs/demo", help="checkpoint directory (dstrain ckpt info/consolidate read it)")
    engine.add_config_arguments(p)
    args = p.parse_args(argv)
    if args.deepspeed_config is None:
        args.deepspeed_config = str(DEFAULT_CONFIG)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=args.seq_len, n_layer=args.layers, d_model=args.d_model, n_head=4,
                          sparsity=_sparsity(args.deepspeed_config, n_head=4)))
    data = ByteCorpus(seq_len=args.seq_len)
    eng, _, loader, _ = engine.initialize(args=args, model=model, training_data=data)
    rank = dist.get_rank()
    start_step = eng.global_steps  # > 0 when checkpoint.auto_resume picked up a previous run
    losses, tokens, t0 = [], 0, time.perf_counter()
    progress = TrainingProgress(args.steps, rank, start_step=start_step)  # rank 0; a live bar on a terminal
    batches = _forever(loader)
    while eng.global_steps < args.steps:
        x, y = next(batches)
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        tokens += x.numel()
        losses.append(loss.item())
        progress.update(eng.global_steps, losses[-1], tokens * dist.get_world_size() / (time.perf_counter() - t0))
    elapsed = time.perf_counter() - t0
    progress.close()
    _summary(eng, losses, tokens, elapsed, args, resumed=start_step > 0)
    return 0


def _sparsity(config_path: str, n_head: int):
    """The config's `sparse_attention` section as the model's attention pattern (DeepSpeed parses the
    section and leaves it to the model; this is the model's side), or None without the section."""
    import schemas
    from ops.sparse_attention import sparsity_config_from
    section = schemas.load_config(config_path, world_size=int(os.environ.get("WORLD_SIZE", "1"))).sparse_attention
    return None if section is None else sparsity_config_from(section, n_head)


def _forever(loader):
    while True:
        yield from loader


def _summary(eng, losses, tokens, elapsed, args, resumed: bool) -> None:
    world = dist.get_world_size()
    rss = eng.comm.all_gather_object(round(rss_mb()))
    total_tokens = tokens * eng.comm.world_size  # data-parallel ranks: tensor-parallel ones share a batch
    eng.save_checkpoint(args.out)  # every rank writes its shards; resumable at any world size and TP degree
    eng.destroy()  # waits for the save, releases the engine's groups, lets gloo's threads finish
    if dist.get_rank() != 0:
        return
    first, last = sum(losses[:5]) / len(losses[:5]), sum(losses[-5:]) / len(losses[-5:])
    print(f"[dstrain] demo done: {eng.global_steps} steps on {world} rank(s), "
          f"loss {first:.3f} -> {last:.3f} (uniform would be {uniform_loss(256):.3f}), "
          f"{total_tokens / elapsed:,.0f} tokens/s, peak RSS per rank {rss} MB, "
          f"skipped steps {eng.skipped_steps}, "
          + f"checkpoint in {args.out}/global_step{eng.global_steps}")
    rows = [("steps", f"{eng.global_steps} on {world} rank(s)"), ("loss", f"{first:.3f} -> {last:.3f}"),
            ("tokens/s", f"{total_tokens / elapsed:,.0f}"), ("time", f"{elapsed:.1f} s"),
            ("peak RSS per rank", f"{max(rss)} MB"), ("skipped steps", str(eng.skipped_steps))]
    written = [f"{args.out}/global_step{eng.global_steps}"]
    print_summary("dstrain demo", rows, written + _monitor_dirs(eng.config), 0)
    if not resumed and not last < first:
        raise SystemExit("[dstrain] the loss did not fall — something is wrong")


def _monitor_dirs(cfg) -> list[str]:
    """Where the config's monitors wrote (`dstrain plot` reads the csv one)."""
    return [str(Path(section.output_path, section.job_name)) for section in (cfg.tensorboard, cfg.csv_monitor)
            if section.enabled]


if __name__ == "__main__":
    sys.exit(main())
