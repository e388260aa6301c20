"""Checkpoint resharding fuzzer: one step at config A (world size, stage, offload drawn), save; load at
config B (drawn again), two more steps; compared with uninterrupted single-process training (parameters and
norms). The global batch is 12 samples in every split, so the reference does not depend on the split.

    python -m tests.fuzz.checkpoint_reshard FIRST_SEED COUNT"""
import os, random, shutil, sys, tempfile
import torch
from tests.harness import run_distributed
from tests.fuzz import zero_training as fuzz

SPLITS = [(1, 3, 4), (2, 2, 3), (2, 3, 2), (3, 2, 2), (4, 1, 3), (2, 1, 6), (3, 1, 4)]  # (world, gas, micro): 12 samples

def side(r):
    world, gas, micro = r.choice(SPLITS)
    stage = r.choice([0, 1, 2, 3])
    return dict(world=world, gas=gas, micro=micro, stage=stage,
                offload=r.choice([None, None, "cpu", "nvme"]) if stage else None,
                offload_param=r.choice([None, None, "cpu", "nvme"]) if stage == 3 else None,
                bucket=r.choice([50, 500000000]))

def draw(seed):
    r = random.Random(seed)
    base = fuzz.draw(seed)
    base.update(aux=False, aux_rank=None, opt=r.choice(["sgd", "sgdm", "adamw"]), clip=r.choice([0.0, 0.3]), steps=3,
                predivide=1.0, prescale=False)
    return base, side(r), side(r)

def cfg_of(c, s, nv):
    zero = {"stage": s["stage"]}
    if s["stage"]:
        zero.update(reduce_bucket_size=s["bucket"], allgather_bucket_size=s["bucket"])
    if s["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 30
    if s["offload"]:
        zero["offload_optimizer"] = {"device": s["offload"], **({"nvme_path": nv} if s["offload"] == "nvme" else {})}
    if s["offload_param"]:
        zero["offload_param"] = {"device": s["offload_param"], **({"nvme_path": nv} if s["offload_param"] == "nvme" else {})}
    return {"train_micro_batch_size_per_gpu": s["micro"], "gradient_accumulation_steps": s["gas"],
            "gradient_clipping": c["clip"], "optimizer": fuzz.optim_cfg(c), "zero_allow_untested_optimizer": True,
            "zero_optimization": zero}

def ranked(c, s, steps, ckdir, load, nv):
    import engine
    from engine import zero as z
    rank = torch.distributed.get_rank()
    os.makedirs(nv, exist_ok=True)
    cfg = cfg_of(c, s, nv)
    if s["stage"] == 3:
        with z.Init(config_dict_or_path=cfg):
            model = fuzz.model_of(c)
    else:
        model = fuzz.model_of(c)
    eng, *_ = engine.initialize(model=model, config=cfg)
    if load:
        eng.load_checkpoint(ckdir)
    norms = fuzz.train_steps(eng, fuzz.side_batches(c, 3), steps, s, rank)
    if not load:
        eng.save_checkpoint(ckdir)
        return None
    return {"params": fuzz.full_params(eng, s["stage"]), "norms": norms}

def reference(c):
    model = fuzz.model_of(c)
    opt = fuzz.torch_opt(c, [p for p in model.parameters() if p.requires_grad])
    norms = []
    for x, y in fuzz.side_batches(c, 3):
        (model(x, y)).backward()
        norms.append(fuzz.reference_step(model, opt, c["clip"]))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms

def check(seed):
    c, a, b = draw(seed)
    tmp = tempfile.mkdtemp(prefix="dstrain_fuzz_ckpt")
    nv = os.path.join(tempfile.gettempdir(), f"dstrain_fuzz_nvme_{os.getuid()}")
    try:
        run_distributed(ranked, a["world"], args=(c, a, [0], tmp, False, nv), timeout=150)
        res = run_distributed(ranked, b["world"], args=(c, b, [1, 2], tmp, True, nv), timeout=150)
    except Exception as e:
        return f"seed {seed} ERROR {str(e)[-3000:]}\n  A {a}\n  B {b}\n  c {c}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ref, rn = reference(c)
    tol = 2e-6 if c["opt"] != "adamw" else 2e-5
    bad = []
    for r, got in enumerate(res):
        for n, want in ref.items():
            g = got["params"][n]
            err = (g - want).abs().max().item() if g.shape == want.shape else float("inf")
            if err > tol: bad.append(f"r{r} {n} err {err:.2e}")
        for x, y in zip(got["norms"], rn[1:]):
            if abs(x - y) > 1e-5 * max(1, abs(y)): bad.append(f"r{r} norm {x} vs {y}"); break
    return f"seed {seed} {'OK' if not bad else 'FAIL ' + '; '.join(bad[:6])}" + (f"\n  A {a}\n  B {b}\n  opt {c['opt']} clip {c['clip']}" if bad else "")

if __name__ == "__main__":
    s0, n = int(sys.argv[1]), int(sys.argv[2])
    for s in range(s0, s0 + n):
        print(check(s), flush=True)
