"""Differential fuzzer: random ZeRO configs (stage 0-3, buckets, overlap, stage-3 knobs, CPU/NVMe offload,
accumulation, clipping, SGD/momentum/AdamW, activation checkpointing) on a model with the shapes of use that
trained wrong before (a head used on one micro-step or one rank only, a weight used twice, a frozen layer),
2-3 ranks, against single-process torch training: every parameter after 3 steps and every reported norm.

    python -m tests.fuzz.zero_training FIRST_SEED COUNT      # prints "seed N OK" or what differed

Not part of the suite (it draws new cases); each failure it found became a test of its own."""
import os
import random
import sys
import torch, torch.nn as nn
from tests.harness import run_distributed

class FuzzNet(nn.Module):
    def __init__(self, d_in, hidden, d_out, tied, frozen, aux, ln, depth):
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden, bias=(i % 2 == 0)) for i in range(depth))
        self.ln = nn.LayerNorm(hidden) if ln else None
        self.tied = tied
        if tied:  # a square matrix used twice: once and its transpose (gradient arrives twice)
            self.shared = nn.Parameter(torch.randn(hidden, hidden) * 0.1)
        self.frozen = nn.Linear(hidden, hidden) if frozen else None
        if frozen:
            for p in self.frozen.parameters():
                p.requires_grad_(False)
        self.aux = nn.Linear(hidden, d_out) if aux else None
        self.scale = nn.Parameter(torch.ones(hidden))
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x, y, use_aux=False):
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = torch.tanh(b(h)) + h
        if self.ln is not None:
            h = self.ln(h)
        if self.tied:
            h = torch.tanh(h @ self.shared) @ self.shared.t()
        if self.frozen is not None:
            h = h + 0.5 * torch.tanh(self.frozen(h))
        h = h * self.scale
        out = self.out(h)
        if self.aux is not None and use_aux:
            out = out + self.aux(h)
        return nn.functional.mse_loss(out, y)

def draw(seed):
    r = random.Random(seed)
    c = dict(world=r.choice([2, 2, 3]), stage=r.choice([0, 1, 2, 3]), gas=r.choice([1, 2, 3]), micro=r.choice([1, 2, 3]),
             d_in=r.choice([7, 13]), hidden=r.choice([11, 24, 31]), d_out=r.choice([3, 5]), depth=r.choice([1, 2, 3]),
             tied=r.random() < 0.5, frozen=r.random() < 0.4, aux=r.random() < 0.5, ln=r.random() < 0.5,
             aux_micro=r.choice([0, -1]),
             opt=r.choice(["sgd", "sgd", "sgdm", "adamw"]), clip=r.choice([0.0, 0.0, 0.3]),
             zero=dict(overlap_comm=r.random() < 0.5, contiguous_gradients=r.random() < 0.5,
                       reduce_scatter=r.random() < 0.7, reduce_bucket_size=r.choice([50, 700, 500000000]),
                       allgather_bucket_size=r.choice([60, 900, 500000000]),
                       round_robin_gradients=r.random() < 0.3),
             z3=dict(stage3_param_persistence_threshold=r.choice([0, 30, 100000]),
                     stage3_prefetch_bucket_size=r.choice([0, 50, 50000000]),
                     stage3_max_live_parameters=r.choice([100, 1000000000])),
             predivide=r.choice([1.0, 1.0, 2.0]), prescale=r.random() < 0.2,
             offload=r.choice([None, None, "cpu", "nvme"]), offload_param=r.choice([None, None, "cpu", "nvme"]),
             aux_rank=r.choice([None, None, 0, 1]) if not os.environ.get("FUZZ_NO_AUXRANK") else None, ckpt=r.choice([None, None, "blocks"]), steps=3)
    return c

def model_of(c):
    torch.manual_seed(1)
    return FuzzNet(c["d_in"], c["hidden"], c["d_out"], c["tied"], c["frozen"], c["aux"], c["ln"], c["depth"])

def batches(c):
    g = torch.Generator().manual_seed(2)
    n = c["micro"] * c["gas"] * c["world"]
    return [(torch.randn(n, c["d_in"], generator=g), torch.randn(n, c["d_out"], generator=g)) for _ in range(c["steps"])]

def micro_of(x, c, rank, k):
    m = c["micro"]; s = (k * c["world"] + rank) * m
    return x[s:s + m]

def side_batches(c, count):
    """Batches of 12 rows, which every side of a reshard fuzzer splits its own way (micro x gas x world)."""
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(12, c["d_in"], generator=g), torch.randn(12, c["d_out"], generator=g)) for _ in range(count)]

def train_steps(eng, data, steps, s, rank, after_step=lambda: None):
    """Trains steps `steps` of `data` at side `s` (its micro, gas and world); the reported norm of each."""
    norms = []
    for i in steps:
        x, y = data[i]
        for k in range(s["gas"]):
            eng.backward(eng(micro_of(x, s, rank, k), micro_of(y, s, rank, k)))
            eng.step()
        norms.append(eng.get_global_grad_norm())
        after_step()
    return norms

def aux_on(c, k, rank):
    return k == (c["aux_micro"] % c["gas"]) and (c.get("aux_rank") is None or c["aux_rank"] == rank)

def optim_cfg(c):
    if c["opt"] == "sgd": return {"type": "SGD", "params": {"lr": 0.2}}
    if c["opt"] == "sgdm": return {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}}
    return {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}

def torch_opt(c, params):
    if c["opt"] == "sgd": return torch.optim.SGD(params, lr=0.2)
    if c["opt"] == "sgdm": return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)

def reference_step(model, opt, clip: float) -> float:
    """The accumulated gradients' norm (what get_global_grad_norm reports), then clip and step."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def full_params(eng, stage: int) -> dict:
    """Every parameter whole on this rank: the fp32 master of trainable ones, frozen ones gathered at stage 3."""
    from engine import zero as z
    from engine.utils import safe_get_full_fp32_param
    out = {}
    for n, p in eng.module.named_parameters():
        if p.requires_grad:
            out[n] = safe_get_full_fp32_param(p)
        else:
            with z.GatheredParameters([p], enabled=stage == 3):
                out[n] = p.detach().clone()
    return out


def reference(c):
    model = model_of(c)
    opt = torch_opt(c, [p for p in model.parameters() if p.requires_grad])
    norms = []
    for x, y in batches(c):
        for k in range(c["gas"]):
            for r in range(c["world"]):
                (model(micro_of(x, c, r, k), micro_of(y, c, r, k), use_aux=aux_on(c, k, r)) / (c["gas"] * c["world"])).backward()
        norms.append(reference_step(model, opt, c["clip"]))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms

def ranked(c):
    import engine
    rank = torch.distributed.get_rank()
    zero = {"stage": c["stage"], **(c["zero"] if c["stage"] > 0 else {})}
    if c["stage"] == 3: zero.update(c["z3"])
    import tempfile
    nv = os.path.join(tempfile.gettempdir(), f"dstrain_fuzz_nvme_{os.getuid()}")
    os.makedirs(nv, exist_ok=True)
    if c["offload"] and c["stage"] > 0:
        zero["offload_optimizer"] = {"device": c["offload"], **({"nvme_path": nv} if c["offload"] == "nvme" else {})}
    if c["offload_param"] and c["stage"] == 3:
        zero["offload_param"] = {"device": c["offload_param"], **({"nvme_path": nv} if c["offload_param"] == "nvme" else {})}
    cfg = {"train_micro_batch_size_per_gpu": c["micro"], "gradient_accumulation_steps": c["gas"],
           "gradient_clipping": c["clip"], "optimizer": optim_cfg(c), "zero_allow_untested_optimizer": True,
           "zero_optimization": zero, "gradient_predivide_factor": c["predivide"], "prescale_gradients": c["prescale"]}
    if c["stage"] == 3:
        from engine import zero as z
        with z.Init(config_dict_or_path=cfg):
            model = model_of(c)
    else:
        model = model_of(c)
    eng, *_ = engine.initialize(model=model, config=cfg, model_parameters=[p for p in model.parameters()])
    norms = []
    for x, y in batches(c):
        for k in range(c["gas"]):
            eng.backward(eng(micro_of(x, c, rank, k), micro_of(y, c, rank, k), use_aux=aux_on(c, k, rank)))
            eng.step()
        norms.append(eng.get_global_grad_norm())
    return {"params": full_params(eng, c["stage"]), "norms": norms}

def check(seed):
    c = draw(seed)
    ref, rnorms = reference(c)
    try:
        res = run_distributed(ranked, c["world"], args=(c,), timeout=120)
    except Exception as e:
        return f"seed {seed} ERROR {str(e)[-12000:]}\n  cfg {c}"
    tol = 2e-6 if c["opt"] != "adamw" else 2e-5
    bad = []
    for r, got in enumerate(res):
        for n, want in ref.items():
            g = got["params"][n]
            if g is None or g.shape != want.shape:
                bad.append(f"r{r} {n} shape {None if g is None else tuple(g.shape)}"); continue
            err = (g - want).abs().max().item()
            if err > tol: bad.append(f"r{r} {n} err {err:.2e}")
        for a, b in zip(got["norms"], rnorms):
            if a is None or abs(a - b) > 1e-5 * max(1, abs(b)):
                bad.append(f"r{r} norm {a} vs {b}"); break
    return f"seed {seed} {'OK' if not bad else 'FAIL ' + '; '.join(bad[:6])}" + ("" if not bad else f"\n  cfg {c}")

if __name__ == "__main__":
    s0, n = int(sys.argv[1]), int(sys.argv[2])
    for s in range(s0, s0 + n):
        print(check(s), flush=True)
