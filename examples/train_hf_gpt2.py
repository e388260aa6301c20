"""Train a transformers GPT-2 (random weights: nothing is downloaded) with dstrain from an HF template.

    python examples/train_hf_gpt2.py                     # one process
    dslaunch --num_gpus 2 examples/train_hf_gpt2.py      # data parallel, ZeRO stage 2
    dslaunch --num_gpus 2 examples/train_hf_gpt2.py --fp16 --deepspeed_config sample_configs/zero3_offload.json
                                                         # ZeRO-3 with optimizer and parameter offload to CPU

`examples/ds_config_hf_zero2.json` is HF Transformers' ZeRO-2 template with its "auto" values (lr,
betas, batch sizes, warmup, reduce_bucket_size, ...). The file is not edited: HF Trainer would fill
those values from its TrainingArguments and the model before DeepSpeed reads the file, and
`schemas.hf_auto_values` fills them the same way, as `config_overrides` for `engine.initialize`.
Needs `pip install "dstrain[hf]"` (transformers and accelerate). The text is the byte-level source of
Python's standard library, as in examples/train_gpt.py.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import engine  # noqa: E402
import schemas  # noqa: E402
from engine.display import TrainingProgress, print_summary  # noqa: E402
from engine.dist import device  # noqa: E402
from examples.gpt import ByteCorpus  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent / "ds_config_hf_zero2.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (TrainingArguments.max_steps)")
    p.add_argument("--micro-batch", type=int, default=4, help="per_device_train_batch_size")
    p.add_argument("--gas", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--lr", type=float, default=1e-3, help="learning_rate")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--fp16", action="store_true", help="TrainingArguments.fp16 (a config with fp16.enabled: true "
                   "needs it, as HF Trainer does; e.g. sample_configs/zero3_offload.json)")
    p.add_argument("--out", default="runs/hf_gpt2", help="TrainingArguments.output_dir")
    engine.add_config_arguments(p)
    args = p.parse_args(argv)
    args.deepspeed_config = args.deepspeed_config or str(TEMPLATE)
    return args


def main(argv=None) -> int:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    args = parse_args(argv)
    engine.init_distributed()  # first, so that TrainingArguments (accelerate) finds the process group
    torch.manual_seed(0)
    training_args = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.gas,
        learning_rate=args.lr, weight_decay=0.01, warmup_steps=max(1, args.steps // 10), max_steps=args.steps,
        fp16=args.fp16, report_to=[], use_cpu=not torch.cuda.is_available())
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=0, eos_token_id=0))  # byte vocabulary
    overrides = schemas.hf_auto_values(args.deepspeed_config, training_args, model.config,
                                       num_training_steps=args.steps, world_size=dist.get_world_size())
    eng, _, loader, _ = engine.initialize(args=args, model=model, model_parameters=model.parameters(),
                                          training_data=ByteCorpus(args.seq_len, max_bytes=400_000),
                                          config_overrides=overrides)
    dev, losses = device(), []
    progress, tokens, t0 = TrainingProgress(args.steps, dist.get_rank()), 0, time.perf_counter()
    while eng.global_steps < args.steps:
        for x, _ in loader:
            loss = eng(input_ids=x.to(dev), labels=x.to(dev)).loss  # GPT-2 shifts the labels itself
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
            tokens += x.numel() * dist.get_world_size()
            progress.update(eng.global_steps, losses[-1], tokens / (time.perf_counter() - t0))
            if eng.global_steps >= args.steps:
                break
    progress.close()
    if dist.get_rank() == 0:
        filled = ", ".join(f"{k}={v}" for k, v in sorted(overrides.items()))
        print(f"[hf_gpt2] filled from TrainingArguments and the model: {filled}")
        first, last = (sum(part) / len(part) for part in (losses[:args.gas], losses[-args.gas:]))
        print(f"[hf_gpt2] steps {eng.global_steps}  loss {first:.3f} -> {last:.3f}  "
              f"lr {eng.get_lr()[0]:.2e}  zero stage {eng.config.zero_optimization.stage}")
        print_summary("hf_gpt2", [("steps", str(eng.global_steps)), ("loss", f"{first:.3f} -> {last:.3f}"),
                                  ("tokens/s", f"{tokens / (time.perf_counter() - t0):,.0f}")], [], 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
