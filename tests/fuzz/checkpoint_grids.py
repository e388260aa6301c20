"""Checkpoint resharding across grids: examples/gpt_pipe.py's GPT as a PipelineModule trained one step at a
drawn pipe × data × model grid (the model axis through AutoTP) and ZeRO stage, saved, loaded at another drawn
grid and stage (1 process included), two more steps; compared with uninterrupted single-process training of
the dense layer list (same per-layer seeds): every rank's parameters (its tensor-parallel shard of the
reference's), the losses and the reported gradient norms. SGD, SGD with momentum or AdamW (optimizer state
must come back row for row), `gradient_clipping: 0`, a global batch of 8 sequences in every split.

    python -m tests.fuzz.checkpoint_grids FIRST_SEED COUNT   # prints "seed N OK" or what differed

Worlds of up to 4 ranks (4 oversubscribes 2 cores: a case takes ~30-60 s). Not part of the suite."""
import random
import shutil
import tempfile

import torch

from tests.harness import run_distributed
from tests.fuzz.cli import main, verdict
from tests.models import micro_batches

GLOBAL, SAVE_AT, STEPS = 8, 1, 3
GRIDS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 4, 1), (1, 1, 4)]
OPTS = {"sgd": ("SGD", {"lr": 0.5}), "sgdm": ("SGD", {"lr": 0.3, "momentum": 0.9}),
        "adamw": ("AdamW", {"lr": 0.01, "weight_decay": 0.01})}


def side(r):
    pipe, data, model = r.choice(GRIDS)
    gas = r.choice([g for g in (1, 2, 4) if GLOBAL % (g * data) == 0])
    return dict(pipe=pipe, data=data, model=model, gas=gas, zero=r.choice([0, 1, 2, 3]))


def draw(seed):
    r = random.Random(seed)
    return dict(opt=r.choice(list(OPTS)), a=side(r), b=side(r))


def gpt_cfg():
    from examples.gpt import GPTConfig
    return GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=4, d_model=16)


def batches():
    g = torch.Generator().manual_seed(0)
    cfg = gpt_cfg()
    return [(torch.randint(0, cfg.vocab_size, (GLOBAL, cfg.seq_len), generator=g),
             torch.randint(0, cfg.vocab_size, (GLOBAL, cfg.seq_len), generator=g)) for _ in range(STEPS)]


def ranked(c, s, steps, ckdir):
    import torch.distributed as dist
    import engine
    from engine.pipe import PipelineModule
    from engine.topology import Topology
    from examples.gpt_pipe import gpt_layers, gpt_loss
    topo = Topology.for_world(dist.get_world_size(), pipe=s["pipe"], model=s["model"])
    pm = PipelineModule(gpt_layers(gpt_cfg()), topology=topo, loss_fn=gpt_loss, seed_layers=True,
                        partition_method="type:BlockLayer")
    kind, params = OPTS[c["opt"]]
    zero = {"stage": s["zero"], **({"stage3_param_persistence_threshold": 0} if s["zero"] == 3 else {})}
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL // (s["gas"] * s["data"]), "gradient_accumulation_steps": s["gas"],
           "optimizer": {"type": kind, "params": params}, "zero_allow_untested_optimizer": True,
           "zero_optimization": zero, "gradient_clipping": 0.0}
    if s["model"] > 1:
        cfg["tensor_parallel"] = {"autotp_size": s["model"]}
    eng, *_ = engine.initialize(model=pm, config=cfg)
    if steps[0] > 0:
        eng.load_checkpoint(ckdir)
    dp, dpr = eng.comm.world_size, eng.comm.rank
    data = batches()
    losses, norms = [], []
    for i in steps:
        x, y = data[i]
        losses.append(float(eng.train_batch(iter(list(micro_batches(x, y, dpr, dp, s["gas"]))))))
        norms.append(eng.get_global_grad_norm())
    if steps[-1] < STEPS - 1:
        eng.save_checkpoint(ckdir)
    with engine.zero.GatheredParameters(list(pm.parameters())):
        out = {n: (p.detach().clone(), getattr(p, "tensor_parallel_dim", None), getattr(p, "tensor_parallel_parts", 1))
               for n, p in pm.named_parameters()}
    coord = tuple(pm.process_groups.coord)
    eng.destroy()
    return {"coord": coord, "params": out, "losses": losses, "norms": norms}


def reference(c):
    from examples.gpt_pipe import gpt_layers, gpt_loss
    from tests.pipe_models import Reference, reference_params
    model = Reference(gpt_layers(gpt_cfg()))
    kind, params = OPTS[c["opt"]]
    opt = getattr(torch.optim, kind)(model.parameters(), **params)
    losses, norms = [], []
    for x, y in batches():
        loss = gpt_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return reference_params(model), losses, norms


def check(seed, timeout=240):
    from engine.tensor_parallel.layers import shard
    c = draw(seed)
    a, b = c["a"], c["b"]
    ckdir = tempfile.mkdtemp(prefix="dstrain_fuzz_grid")
    try:
        run_distributed(ranked, a["pipe"] * a["data"] * a["model"], args=(c, a, list(range(SAVE_AT)), ckdir), timeout=timeout)
        res = run_distributed(ranked, b["pipe"] * b["data"] * b["model"], args=(c, b, list(range(SAVE_AT, STEPS)), ckdir),
                              timeout=timeout)
    except Exception as e:
        return f"seed {seed} ERROR {str(e)[-3000:]}\n  cfg {c}"
    finally:
        shutil.rmtree(ckdir, ignore_errors=True)
    want, rl, rn = reference(c)
    tol = 2e-5 if c["opt"] == "adamw" else 1e-5
    bad, seen = [], set()
    for got in res:
        pipe, _, model = got["coord"]
        if any(abs(x - y) > 1e-5 * max(1, abs(y)) for x, y in zip(got["losses"], rl[SAVE_AT:])):
            bad.append(f"{got['coord']} losses {got['losses']} vs {rl[SAVE_AT:]}")
        if any(x is None or abs(x - y) > 1e-5 * max(1, abs(y)) for x, y in zip(got["norms"], rn[SAVE_AT:])):
            bad.append(f"{got['coord']} norms {got['norms']} vs {rn[SAVE_AT:]}")
        for n, (p, dim, parts) in got["params"].items():
            if pipe > 0 and n == "tied_modules.embeddings.pos.weight":
                continue  # the head's copy of the embeddings: its position table is never used
            if n not in want:
                bad.append(f"{got['coord']} unknown {n}"); continue
            w = want[n] if dim is None else shard(want[n], dim, model, b["model"], parts)
            err = (p - w).abs().max().item() if p.shape == w.shape else float("inf")
            if err > tol:
                bad.append(f"{got['coord']} {n} err {err:.2e}")
            seen.add(n)
    if seen != set(want):
        bad.append(f"missing {sorted(set(want) - seen)}")
    return verdict(seed, bad, c)


if __name__ == "__main__":
    main(check)
