"""Do bench_infinity.py's two systems compute the same training? `--check-against-torch` there.

Each system's rank 0 writes its full fp32 parameters after the last step (`dump_full_params`, every
rank calls it: gathering a stage-3 parameter is a collective), and `torch_reference` trains the same
GPT in one process on the same global batch (the ranks' micro-batches, each rank's mean loss averaged,
as data parallelism averages gradients), with torch's AdamW and `clip_grad_norm_`. `compare` then says,
per system, how far each parameter is from the reference in units of the reference's own update
(‖final − initial‖ per tensor): a system that computes the same thing is at ~1e-3 of it or less (float reduction
order), one that drops or mis-scales an update is at ~1. Imports only torch (deepspeed_infinity_peer.py
runs it in DeepSpeed's venv) and examples/gpt.py.
"""
from __future__ import annotations

from pathlib import Path

import torch

from examples.gpt import GPT, GPTConfig, RandomTokens


def dump_full_params(model: torch.nn.Module, full_fp32, path: str | Path, rank: int) -> None:
    """`full_fp32(param)` (engine.utils's or deepspeed.utils's safe_get_full_fp32_param) for every
    parameter of `model`, saved by rank 0 to `path` as {name: tensor}; a tied parameter once, under its
    first name (named_parameters' rule)."""
    out = {}
    for name, p in model.named_parameters():
        full = full_fp32(p)
        if rank == 0:  # flat: compare() takes the shape from the reference
            out[name] = full.detach().to(device="cpu", dtype=torch.float32, copy=True).reshape(-1)
    if rank == 0:
        torch.save(out, path)


def torch_reference(model_cfg: GPTConfig, cfg: dict, steps: int, world: int) -> dict:
    """Single-process torch on bench_infinity's workload: rank 0's loss and the global gradient norm
    (before clipping) per step, the initial and final parameters."""
    torch.manual_seed(0)
    model = GPT(model_cfg)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = cfg["optimizer"].get("params", {})
    # DeepSpeed's AdamW defaults where the config is silent: weight decay 0 (FusedAdam / DeepSpeedCPUAdam)
    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=tuple(params.get("betas", (0.9, 0.999))),
                            eps=params.get("eps", 1e-8), weight_decay=params.get("weight_decay", 0.0))
    micro, clip = cfg["train_micro_batch_size_per_gpu"], cfg.get("gradient_clipping", 0.0)
    batches = [RandomTokens(micro, model_cfg.seq_len, model_cfg.vocab_size, seed=r)[:] for r in range(world)]
    losses, norms = [], []
    for _ in range(steps):
        per_rank = [model(x, y) for x, y in batches]
        (sum(per_rank) / world).backward()
        grads = [p.grad for p in model.parameters()]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(per_rank[0].detach()))
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "initial": initial, "final": final}


def compare(dump: dict[str, torch.Tensor], ref: dict, worst: int = 4) -> dict:
    """Per parameter: ‖system − reference‖ / ‖reference's update‖ (2-norms over the tensor; a max would
    be ruled by the elements whose gradient is near Adam's eps, where rounding decides the update's
    sign); the largest `worst` of them, the overall largest, and names the dump lacks or adds."""
    rel = {}
    for name, want in ref["final"].items():
        if name not in dump:
            continue
        step = float(torch.linalg.vector_norm(want - ref["initial"][name])) or 1.0
        rel[name] = float(torch.linalg.vector_norm(dump[name].reshape(want.shape) - want)) / step
    ranked = sorted(rel.items(), key=lambda kv: -kv[1])
    return {"max": ranked[0][1] if ranked else float("nan"), "worst": ranked[:worst],
            "missing": sorted(set(ref["final"]) - set(dump)), "extra": sorted(set(dump) - set(ref["final"]))}
