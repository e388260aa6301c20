"""Small layer lists for the pipeline tests, and the single-process reference they are compared to."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from engine.pipe import LayerSpec, TiedLayerSpec

D, VOCAB, SEQ = 8, 11, 5


def mlp_specs(n_layers: int = 8) -> list:
    """Linear+Tanh blocks (as specs, built lazily on their stage) ending in a regression head."""
    return [LayerSpec(nn.Linear, D, D) if i % 2 == 0 else nn.Tanh() for i in range(n_layers)]


def mse(out, y):
    return nn.functional.mse_loss(out, y)


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, D) * 0.3)

    def forward(self, tokens):
        return nn.functional.embedding(tokens, self.weight)


def lm_head(embed: Embed, h):
    return h @ embed.weight.t()


def tied_specs(n_hidden: int = 4) -> list:
    """Token embedding tied to the LM head (first and last stage), Linear blocks between."""
    hidden = [LayerSpec(nn.Linear, D, D) if i % 2 == 0 else nn.Tanh() for i in range(n_hidden)]
    return [TiedLayerSpec("embed", Embed), *hidden, TiedLayerSpec("embed", Embed, forward_fn=lm_head)]


def lm_loss(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


class Reference(nn.Module):
    """The same layer list in one process, built with the same per-layer seeds (seed_layers=True)."""

    def __init__(self, specs: list, base_seed: int = 1234):
        super().__init__()
        self.funcs, self.mods, tied = [], nn.ModuleList(), {}
        self.named = {}  # pipeline-style name prefix -> module ("3", "tied_modules.embed")
        for i, spec in enumerate(specs):
            torch.manual_seed(base_seed + i)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:
                    tied[spec.key] = spec.build()
                    self.mods.append(tied[spec.key])
                    self.named[f"tied_modules.{spec.key}"] = tied[spec.key]
                m = tied[spec.key]
                self.funcs.append((lambda x, m=m, f=spec.forward_fn: f(m, x) if f else m(x)))
            elif isinstance(spec, LayerSpec):
                m = spec.build()
                self.mods.append(m)
                self.named[str(i)] = m
                self.funcs.append(m)
            else:
                m = copy.deepcopy(spec)
                self.funcs.append(m)

    def forward(self, x):
        for f in self.funcs:
            x = f(x)
        return x


def reference_sgd(specs, batches, loss_fn, lr: float, steps: int, clip: float = 0.0, skip: set = frozenset(),
                  norms: list | None = None, momentum: float = 0.0):
    """Plain SGD (with `momentum`) on the global batch: the model and the loss per step. `clip`: torch's
    clip_grad_norm_ (its pre-clip norms appended to `norms`); steps in `skip` are not applied (an overflow)."""
    model = Reference(specs)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for step, (x, y) in enumerate(batches[:steps]):
        loss = loss_fn(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        if norms is not None:
            norms.append(float(norm))
        if step not in skip:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def reference_params(model: Reference) -> dict[str, torch.Tensor]:
    """The reference's parameters under the PipelineModule's names."""
    return {f"{prefix}.{n}": p.detach() for prefix, m in model.named.items() for n, p in m.named_parameters()}


def global_batches(steps: int, batch: int, tied: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if tied:
        return [(torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g))
                for _ in range(steps)]
    return [(torch.randn(batch, D, generator=g), torch.randn(batch, D, generator=g)) for _ in range(steps)]


class TokensToDict(nn.Module):
    """First layer: tokens → what real models pass between blocks: activations with grad, an integer
    mask, a float tensor without grad, and a constant."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], dtype=torch.float32, device=tokens.device).expand(tokens.shape)
        return {"h": self.embed(tokens), "mask": (tokens % 3 != 0).long(), "pos": positions, "scale": 0.5}


class DictBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, d):
        h = torch.tanh(self.lin(d["h"])) * d["mask"].unsqueeze(-1) + d["pos"].unsqueeze(-1) * 0.01 * d["scale"]
        return {**d, "h": h}


class DictHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(D, VOCAB)

    def forward(self, d):
        return self.out(d["h"])


def dict_specs() -> list:
    return [LayerSpec(TokensToDict), LayerSpec(DictBlock), LayerSpec(DictBlock), LayerSpec(DictHead)]


def varying_length_batches(steps: int, batch: int, seed: int = 0):
    """Token batches whose sequence length changes from step to step (5, 7, 5, 7, ...)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        seq = 5 if step % 2 == 0 else 7
        out.append((torch.randint(0, VOCAB, (batch, seq), generator=g), torch.randint(0, VOCAB, (batch, seq), generator=g)))
    return out


def trained_state(pm, eng) -> dict:
    """One rank's parameters and step counters (the LR shows the scheduler's step count)."""
    return {"params": {n: p.detach().clone() for n, p in pm.named_parameters()},
            "counters": (eng.global_steps, eng.micro_steps, eng.skipped_steps, eng.get_lr())}


def assert_trained_alike(a: dict, b: dict, losses: tuple) -> None:
    """Engines A and B (each `{"params", "counters"}` of one rank) ended bit for bit alike, with the same
    losses on the way (a run that met failing calls between its steps, and one that did not)."""
    assert a["counters"] == b["counters"]
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert a["params"][name].equal(b["params"][name]), name
    assert losses[0] == losses[1]
