"""Pipeline fuzzer: random schedule, stage count, data-parallel size, layer list (plain, tied embedding/head,
dict boundaries), accumulation, ZeRO stage, clipping, momentum, partition method and activation
checkpoint interval, against single-process SGD: losses, norms and every parameter after 3 batches.

    python -m tests.fuzz.pipeline_schedules FIRST_SEED COUNT"""
import random, sys
from tests.harness import run_distributed
from tests.pipe_models import (global_batches, lm_loss, mlp_specs, mse, reference_params, reference_sgd, tied_specs,
                               dict_specs)
from tests.models import micro_batches

LR, MICRO, STEPS = 0.1, 2, 3

def draw(seed):
    r = random.Random(seed)
    world = r.choice([2, 2, 4])
    stages = r.choice([2, 4]) if world == 4 else 2
    schedule = r.choice(["1f1b", "1f1b", "gpipe", "interleaved_1f1b", "zero_bubble"])
    virtual = 2 if schedule in ("interleaved_1f1b", "zero_bubble") else 1
    kind = r.choice(["mlp", "tied", "dict"])
    n = r.choice([8, 10, 12, 16])
    gas = r.choice([1, 2, 3, 4, 5])
    if virtual > 1:
        gas = stages * r.choice([1, 2])
    if kind == "dict" and stages * virtual > 4:
        kind = "tied"
    return dict(world=world, stages=stages, schedule=schedule, virtual=virtual, kind=kind, n=n,
                gas=gas, zero=r.choice([0, 1, 2, 3]), clip=r.choice([0.0, 0.0, 0.05]),
                momentum=r.choice([0.0, 0.9]), part=r.choice(["uniform", "parameters"]),
                ckpt=r.choice([0, 0, 1, 2]))

def specs_of(c):
    if c["kind"] == "tied": return tied_specs(c["n"] - 2), lm_loss, True
    if c["kind"] == "dict": return dict_specs(), lm_loss, True
    return mlp_specs(c["n"]), mse, False

def ranked(c):
    import engine
    from engine.pipe import PipelineModule
    specs, loss_fn, tok = specs_of(c)
    pm = PipelineModule(specs, num_stages=c["stages"], loss_fn=loss_fn, seed_layers=True, partition_method=c["part"],
                        virtual_stages=c["virtual"], activation_checkpoint_interval=c["ckpt"])
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": c["gas"],
           "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": c["momentum"]}}, "zero_allow_untested_optimizer": True,
           "gradient_clipping": c["clip"], "pipeline": {"schedule": c["schedule"]}, "zero_optimization": {"stage": c["zero"]}}
    eng, *_ = engine.initialize(model=pm, config=cfg)
    dp, dpr = eng.comm.world_size, eng.comm.rank
    losses, norms = [], []
    for x, y in global_batches(STEPS, MICRO * c["gas"] * dp, tok):
        losses.append(float(eng.train_batch(iter(list(micro_batches(x, y, dpr, dp, c["gas"]))))))
        norms.append(eng.get_global_grad_norm())
    from engine.utils import safe_get_full_fp32_param
    params = {}
    for n, p in pm.named_parameters():
        params[n] = safe_get_full_fp32_param(p) if c["zero"] == 3 else p.detach().clone()
    return params, losses, norms

def check(seed):
    c = draw(seed)
    specs, loss_fn, tok = specs_of(c)
    dp = c["world"] // c["stages"]
    try:
        res = run_distributed(ranked, c["world"], args=(c,), timeout=180)
    except Exception as e:
        msg = str(e)
        return f"seed {seed} ERROR {msg[-2500:]}\n  cfg {c}"
    rn = []
    ref, rl = reference_sgd(specs, global_batches(STEPS, MICRO * c["gas"] * dp, tok), loss_fn, LR, STEPS, clip=c["clip"],
                            norms=rn, momentum=c["momentum"])
    want = reference_params(ref)
    bad, seen = [], set()
    for r, (params, losses, norms) in enumerate(res):
        if any(abs(a - b) > 1e-5 * max(1, abs(b)) for a, b in zip(losses, rl)): bad.append(f"r{r} losses {losses} vs {rl}")
        if any(a is None or abs(a - b) > 1e-5 * max(1, abs(b)) for a, b in zip(norms, rn)): bad.append(f"r{r} norms {norms} vs {rn}")
        for n, p in params.items():
            if n not in want: bad.append(f"r{r} unknown {n}"); continue
            if p.shape != want[n].shape: bad.append(f"r{r} {n} shape {tuple(p.shape)}"); continue
            err = (p - want[n]).abs().max().item()
            if err > 2e-6: bad.append(f"r{r} {n} err {err:.2e}")
            seen.add(n)
    if seen != set(want): bad.append(f"missing {set(want) - seen}")
    return f"seed {seed} {'OK' if not bad else 'FAIL ' + '; '.join(bad[:5])}" + (f"\n  cfg {c}" if bad else "")

if __name__ == "__main__":
    s0, n = int(sys.argv[1]), int(sys.argv[2])
    for s in range(s0, s0 + n):
        print(check(s), flush=True)
