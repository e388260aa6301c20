"""Activation checkpointing (`engine.checkpointing`, the `activation_checkpointing` section) changes
memory, never the math.

Oracles: with dropout on, a checkpointed model gives bit-identical losses and gradients to the plain
one on one process (the recompute replays the RNG); through `initialize` at ZeRO stages 0-3 on 2 ranks
the weights after SGD steps (no momentum, no clipping: the update is linear in the gradient) equal a
single-process reference without checkpointing that replays each rank's RNG stream (atol 2e-6: only
the order of the rank sum differs). Memory: `SavedActivationProbe` counts the bytes autograd holds for
backward at the peak, and full checkpointing of a 24-block model must hold at most 1/4 of the plain one.
Recompute: `RecomputeProbe` counts the ops each policy's recomputes really execute on the example GPT
(below torch's selective cache), against the ops its rule names.
"""
from __future__ import annotations

import collections
import copy
import functools
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import engine
import schemas
from engine.utils import safe_get_full_fp32_param
from schemas.features import ActivationCheckpointingConfig
from tests.harness import run_distributed

ckpt = engine.checkpointing
from engine.activation_checkpointing import contiguous as ckpt_contiguous  # noqa: E402
from engine.activation_checkpointing import settings as ckpt_settings  # noqa: E402
D = 16


class Block(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)
        self.drop = nn.Dropout(0.2)

    def forward(self, h):
        return self.norm(h + self.drop(self.down(torch.nn.functional.gelu(self.up(h)))))


class BlockNet(nn.Module):
    """`layers` blocks in a ModuleList (what `checkpoint_blocks` finds), dropout inside each; with
    `api` set, the forward checkpoints each block itself with that engine.checkpointing function,
    and with `shared`, one block is reached twice in one backward."""

    def __init__(self, layers: int = 3, api=None, shared: bool = False, d_in: int = 7):
        super().__init__()
        self.inp, self.out = nn.Linear(d_in, D), nn.Linear(D, 3)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.api, self.shared = api, shared

    def forward(self, x, y):
        h = self.inp(x)
        order = list(self.blocks) + ([self.blocks[0]] if self.shared else [])
        for block in order:
            h = block(h) if self.api is None else self.api(block, h)
        return nn.functional.mse_loss(self.out(h), y)


def _loss_and_grads(model, x, y, seed=5):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: a second intra-op thread only waits for a core of a shared machine
    (an order of magnitude on every op under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_settings():
    ckpt.unconfigure()
    yield
    ckpt.unconfigure()


def _selective(fn, *args):
    return ckpt.non_reentrant_checkpoint(fn, *args, context_fn=ckpt.selective_context)


def _all_matmuls(fn, *args):
    return ckpt.non_reentrant_checkpoint(fn, *args, context_fn=ckpt.all_matmuls_context)


def _unpacked(fn, *args):
    with ckpt.recompute_on_unpack():
        return fn(*args)


def _tracked(block, h):
    """The checkpointed function draws dropout on the tracked model-parallel stream."""
    def run(t):
        with ckpt.get_cuda_rng_tracker().fork():
            return block(t)
    return ckpt.checkpoint(run, h)


VARIANTS = {"reentrant": (ckpt.checkpoint, {}), "non_reentrant": (ckpt.non_reentrant_checkpoint, {}),
            "selective": (_selective, {}), "selective_all_matmuls": (_all_matmuls, {}),
            "selective_unpack": (_unpacked, {}),
            "reentrant-cpu": (ckpt.checkpoint, {"checkpoint_in_cpu": True}),
            "non_reentrant-cpu": (ckpt.non_reentrant_checkpoint, {"checkpoint_in_cpu": True}),
            "rng-tracker": (_tracked, {})}


@pytest.mark.parametrize("shared", [False, True], ids=["once", "block-reached-twice"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpointed_model_is_bit_identical_to_the_plain_one(variant, shared):
    api, settings = VARIANTS[variant]
    ckpt.configure(**settings)
    torch.manual_seed(0)
    plain = BlockNet(shared=shared)
    checkpointed = copy.deepcopy(plain)
    checkpointed.api = api
    x, y = torch.randn(6, 7), torch.randn(6, 3)
    if variant == "rng-tracker":
        ckpt.model_parallel_cuda_manual_seed(11)
        plain.api = _tracked_plain
    want_loss, want = _loss_and_grads(plain, x, y)
    if variant == "rng-tracker":
        ckpt.model_parallel_cuda_manual_seed(11)
    got_loss, got = _loss_and_grads(checkpointed, x, y)
    assert torch.equal(got_loss, want_loss)
    for name, g in want.items():
        assert torch.equal(got[name], g), name


def _tracked_plain(block, h):
    with ckpt.get_cuda_rng_tracker().fork():
        return block(h)


def test_dropout_is_on_so_the_rng_replay_is_tested():
    torch.manual_seed(0)
    model = BlockNet()
    x, y = torch.randn(6, 7), torch.randn(6, 3)
    assert not torch.equal(_loss_and_grads(model, x, y, seed=1)[0], _loss_and_grads(model, x, y, seed=2)[0])


# -- memory -----------------------------------------------------------------------------------------
def _peak_bytes(policy: str, api=None, layers: int = 24) -> int:
    torch.manual_seed(0)
    model = BlockNet(layers=layers, api=api, d_in=D)
    if policy != "none":
        ckpt.checkpoint_blocks(model, ActivationCheckpointingConfig(checkpoint_blocks=True, policy=policy))
    x, y = torch.randn(64, D), torch.randn(64, 3)
    with ckpt.SavedActivationProbe(model.parameters()) as probe:
        model(x, y).backward()
    assert probe.live_bytes == 0 or policy == "selective"  # everything saved was freed by backward
    return probe.peak_bytes


def test_full_checkpointing_holds_at_most_a_quarter_of_the_activations():
    none = _peak_bytes("none")
    full_config = _peak_bytes("full")
    full_reentrant = _peak_bytes("none", api=ckpt.checkpoint)  # the recompute runs under the probe
    selective, all_matmuls = _peak_bytes("selective"), _peak_bytes("selective_all_matmuls")
    unpack = _peak_bytes("selective_unpack")
    assert none > 0
    assert full_config <= none / 4, (full_config, none)
    assert full_reentrant <= none / 4, (full_reentrant, none)
    # the selective rules keep matmul outputs: between full and none; the default one at most half of none
    assert full_config < selective <= none / 2, (full_config, selective, none)
    assert selective < all_matmuls <= 0.75 * none, (selective, all_matmuls, none)
    # "selective_unpack" holds what the backward of the up projection, dropout and norm read (their
    # inputs and the mask) and remakes the up projection's and GELU's outputs: under half of none
    assert full_config < unpack <= none / 2, (full_config, unpack, none)
    # what "selective" recomputes and "selective_all_matmuls" keeps: the 4x-wide up projection's
    # output, 64 x 4D fp32 per block (policy.py); both keep the down projection's
    assert all_matmuls - selective == 24 * 64 * 4 * D * 4, (all_matmuls, selective)


def test_selective_unpack_holds_at_most_half_of_a_gpt_whose_head_is_large():
    """The benchmark GPT's proportions (6 blocks, vocabulary 23x the width, baselines.md's 25M model scaled
    down): the head's log-softmax, held under every policy, is a sixth of what the plain model holds, so
    the blocks alone do not bring "selective_unpack" under half; the model's own region remakes the final
    norm's output too (apply.py), and the gradients stay bit-identical."""
    from examples.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=750, seq_len=16, n_layer=6, n_head=2, d_model=32)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    peaks, grads = {}, {}
    for policy in ("none", "selective_unpack"):
        torch.manual_seed(0)
        model = GPT(cfg)
        if policy != "none":
            ckpt.checkpoint_blocks(model, ActivationCheckpointingConfig(checkpoint_blocks=True, policy=policy))
        with ckpt.SavedActivationProbe(model.parameters()) as probe:
            model(idx, idx).backward()
        peaks[policy], grads[policy] = probe.peak_bytes, {n: p.grad for n, p in model.named_parameters()}
    assert peaks["selective_unpack"] <= peaks["none"] / 2, peaks
    assert all(torch.equal(grads["selective_unpack"][n], g) for n, g in grads["none"].items())


class _ChangesASavedTensor(nn.Module):
    def forward(self, h):
        y = torch.sigmoid(h)  # autograd saves sigmoid's output for its backward
        out = y.sum()
        y.add_(1)  # ... and it is changed before that backward
        return out


class _ReusesMemory(nn.Module):
    """A GELU output nobody keeps, then a tensor of the same shape that autograd saves: the allocator
    hands the second the first's memory unless the policy holds what it recorded until the forward ends."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(64, 64))

    def forward(self, h):
        torch.nn.functional.gelu(h).sum().detach()
        u = h * 3
        return h + u * self.p  # mul saves u


class _ChangesACopysSource(nn.Module):
    """A copy (recomputable, its backward saves nothing) whose source is then changed in place: the
    copy autograd saves cannot be made again from the source, so it must be held."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(8, 8))

    def forward(self, h):
        a = h * 1
        y = a.clone()
        a.mul_(2)
        return a + y * self.p  # mul saves y


@pytest.mark.parametrize("module", [_ReusesMemory, _ChangesACopysSource])
def test_selective_unpack_remakes_only_what_it_recorded(module):
    """Gradients equal the plain model's when the allocator reuses a freed output's memory, and when an
    in-place change made a recorded call stale (then the output is held, not remade)."""
    torch.manual_seed(0)
    plain = nn.Sequential(module(), module())
    model = copy.deepcopy(plain)
    ckpt.checkpoint_blocks(model, ActivationCheckpointingConfig(checkpoint_blocks=True, policy="selective_unpack"))
    x = torch.randn(*plain[0].p.shape, requires_grad=True)
    for m in (plain, model):
        m(x).sum().backward()
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)


class _SavesItsOutput(nn.Module):
    def forward(self, h):
        self.out = torch.sigmoid(h)
        return self.out * 2


def test_selective_unpack_forward_without_backward_frees_everything():
    """Evaluation with grad on (no backward): what the policy recorded and packed dies with the graph."""
    import gc
    from examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
    ckpt.checkpoint_blocks(model, ActivationCheckpointingConfig(checkpoint_blocks=True, policy="selective_unpack"))
    seen = []
    model.blocks[0].fc.register_forward_hook(lambda m, i, out: seen.append(weakref.ref(out)))
    loss = model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    # an output its own node saves (sigmoid's), held as it is: no cycle through that node
    sigmoids = nn.Sequential(_SavesItsOutput(), _SavesItsOutput())
    ckpt.checkpoint_blocks(sigmoids, ActivationCheckpointingConfig(checkpoint_blocks=True, policy="selective_unpack"))
    out = sigmoids(torch.randn(4, 4, requires_grad=True))
    seen += [weakref.ref(m.out) for m in sigmoids]
    del loss, out
    for m in sigmoids:
        del m.out
    gc.collect()
    assert len(seen) == 3 and all(ref() is None for ref in seen), "a tensor outlived its graph"


class _CopiesWithoutGrad(nn.Module):
    def forward(self, h):
        with torch.no_grad():
            scratch = h.clone()  # a recomputable op, but under no_grad: nothing backward could need
        self.scratch = weakref.ref(scratch)
        del scratch
        self.freed_at_once = self.scratch() is None
        return h * 2


def test_selective_unpack_keeps_nothing_made_under_no_grad_alive():
    """A copy made under no_grad inside a region (as ZeRO-3's gathers in the blocks' hooks, which run in
    the model's own region) is freed when it is dropped, not held to the region's end."""
    model = nn.Sequential(_CopiesWithoutGrad(), _CopiesWithoutGrad())
    ckpt.checkpoint_blocks(model, ActivationCheckpointingConfig(checkpoint_blocks=True, policy="selective_unpack"))
    model(torch.randn(4, requires_grad=True)).sum().backward()
    assert all(m.freed_at_once for m in model)


class _CopyThenChangesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.w = nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = self.fc(x)  # autograd saves no addmm output
        z = h.transpose(0, 1).contiguous() * self.w[:, None]  # the copy's recipe holds h; the mul saves the copy
        h.add_(1.0)  # legal in plain autograd: nothing it saved is h
        return z.transpose(0, 1) + h


def test_selective_unpack_accepts_an_in_place_change_plain_autograd_accepts():
    """A copy's recipe holds its input, which autograd itself need not keep: changed in place later in the
    forward, the recipe is made before the change (unpack_recompute.py's note) and gradients stay exact."""
    torch.manual_seed(0)
    plain = nn.Sequential(_CopyThenChangesItsInput(), _CopyThenChangesItsInput())
    model = copy.deepcopy(plain)
    ckpt.checkpoint_blocks(model, ActivationCheckpointingConfig(checkpoint_blocks=True, policy="selective_unpack"))
    x = torch.randn(8, 8)
    for m in (plain, model):
        m(x).pow(2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_selective_unpack_refuses_a_saved_tensor_changed_in_place_and_cpu_checkpointing():
    model = nn.Sequential(_ChangesASavedTensor(), _ChangesASavedTensor())
    ckpt.checkpoint_blocks(model, ActivationCheckpointingConfig(checkpoint_blocks=True, policy="selective_unpack"))
    with pytest.raises(RuntimeError, match="policy 'selective_unpack'.*changed in place"):
        model(torch.randn(4, requires_grad=True)).backward()
    with pytest.raises(ValueError, match="activation_checkpointing.policy: 'selective_unpack'.*cpu_checkpointing"):
        ckpt.checkpoint_blocks(BlockNet(), ActivationCheckpointingConfig(checkpoint_blocks=True, cpu_checkpointing=True,
                                                                         policy="selective_unpack"))


def test_cpu_checkpointing_bytes_are_reported_to_the_probe():
    ckpt.configure(checkpoint_in_cpu=True)
    assert _peak_bytes("none", api=ckpt.checkpoint, layers=4) > 0


# -- what the policies recompute, on the example GPT (the benchmark's model) ---------------------------------
GPT_LAYERS = 2
EXPENSIVE = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_dot_product_flash_attention_for_cpu"}


def _gpt_step(policy: str, dropout: float) -> tuple:
    """(loss, gradients, the ops recomputes ran again) of one step of a small example GPT."""
    from examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=GPT_LAYERS, n_head=2, d_model=32, dropout=dropout))
    if policy != "none":
        ckpt.checkpoint_blocks(model, ActivationCheckpointingConfig(checkpoint_blocks=True, policy=policy))
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    with ckpt.RecomputeProbe() as probe:
        loss = model(idx, idx)
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, probe.counts


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["flash-sdpa", "dropout-math-sdpa"])
def test_each_policy_recomputes_what_its_rule_says_and_the_gpt_stays_exact(dropout):
    """The recompute, seen below torch's selective-checkpoint cache: full runs every matmul of a block
    again but its last (the down projection: the recompute stops at the last saved tensor, its input);
    "selective" only the up projection (the one matmul 4x wider than its input) besides the cheap ops;
    "selective_all_matmuls" no matmul or attention kernel; "selective_unpack" (no checkpoint region:
    each dropped output remade once when backward unpacks it) the up projection and the cheap ops, and
    the final layer norm (not the head's matmul: its logits are not saved). Loss and gradients are
    bit-identical to the plain model's, dropout (SDPA's, on the tracked CPU generator) included."""
    want_loss, want, nothing = _gpt_step("none", dropout)
    assert not nothing
    attention = 2 if dropout else 1  # with dropout, CPU SDPA is the math kernel: two bmm per block
    matmuls = {"full": 3 + attention, "selective": 1, "selective_all_matmuls": 0, "selective_unpack": 1}
    for policy, expensive in matmuls.items():
        loss, grads, ran = _gpt_step(policy, dropout)
        assert torch.equal(loss, want_loss), policy
        assert all(torch.equal(grads[n], g) for n, g in want.items()), policy
        assert sum(n for op, n in ran.items() if op.rsplit(".", 1)[0] in EXPENSIVE) == expensive * GPT_LAYERS, \
            (policy, ran)
        if policy in ("selective", "selective_unpack"):
            assert ran["aten.addmm.default"] == GPT_LAYERS, ran  # the up projection, nothing else
        # the cheap rest runs again under every policy: both layer norms and the activation of each block;
        # "selective_unpack" remakes the final layer norm's output too (the model's own region, apply.py)
        final_norm = 1 if policy == "selective_unpack" else 0
        assert ran["aten.native_layer_norm.default"] == 2 * GPT_LAYERS + final_norm, (policy, ran)
        assert ran["aten.gelu.default"] == GPT_LAYERS, (policy, ran)
        if dropout:  # the dropout mask is drawn again; "selective_unpack" holds it and replays nothing
            assert ran["aten.bernoulli_.float"] == (0 if policy == "selective_unpack" else GPT_LAYERS), ran


class _EveryOp(TorchDispatchMode):
    """Counts every aten op that runs (forward, recompute and backward alike)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _every_op_of_a_gpt_step(wrap) -> collections.Counter:
    from examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=GPT_LAYERS, n_head=2, d_model=32, dropout=0.1))
    wrap(model)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with _EveryOp() as ops:
        model(idx, idx).backward()
    return ops.counts


def test_full_runs_exactly_the_ops_of_torchs_own_checkpoint():
    """Issue 19's floor for full checkpointing: torch's `checkpoint(use_reentrant=False)` wrapped around
    each block directly. dstrain's `checkpoint_blocks` (policy full) runs the same aten ops, the same
    number of times, in forward, recompute and backward: no extra copy, detach or kernel of its own
    (the step-time comparison is benchmarks/bench_long_sequence.py's `torch_full` row)."""
    def plain(model):
        pass

    def torchs(model):
        for block in model.blocks:
            block.forward = functools.partial(torch_checkpoint, block.forward, use_reentrant=False)

    def dstrains(model):
        ckpt.checkpoint_blocks(model, ActivationCheckpointingConfig(checkpoint_blocks=True, policy="full"))

    ours, floor, none = (_every_op_of_a_gpt_step(wrap) for wrap in (dstrains, torchs, plain))
    assert ours == floor, {op: (ours[op], floor[op]) for op in ours.keys() | floor.keys() if ours[op] != floor[op]}
    assert ours != none  # the oracle sees a recompute: full runs more than the plain model


# -- config and configure() ---------------------------------------------------------------------------
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0}


def test_configure_reads_the_section_and_explicit_arguments_win():
    section = {"cpu_checkpointing": True, "profile": True, "synchronize_checkpoint_boundary": True}
    ckpt.configure(deepspeed_config={**BASE, "activation_checkpointing": section}, checkpoint_in_cpu=False)
    settings = ckpt_settings.STATE.settings
    assert ckpt.is_configured() and settings.profile and settings.synchronize and not settings.cpu_checkpointing
    # initialize() configures from the section again: the explicit argument still wins
    ckpt.configure(deepspeed_config={**BASE, "activation_checkpointing": {"cpu_checkpointing": True}})
    assert not ckpt_settings.STATE.settings.cpu_checkpointing and not ckpt_settings.STATE.settings.profile
    ckpt.unconfigure()
    assert not ckpt.is_configured() and not ckpt_settings.STATE.settings.profile


def test_profile_reports_forward_and_recompute_per_checkpoint():
    ckpt.configure(profile=True)
    torch.manual_seed(0)
    model = BlockNet(api=ckpt.checkpoint)
    _loss_and_grads(model, torch.randn(6, 7), torch.randn(6, 3))
    summary = ckpt.profile_summary()
    assert len(summary) == 3 and all(set(s) == {"forward", "recompute"} for s in summary.values())


@pytest.mark.parametrize("section, words", [
    ({"contiguous_memory_optimization": True, "number_checkpoints": 4},
     "activation_checkpointing.contiguous_memory_optimization: true needs activation_checkpointing.partition_"),
    ({"contiguous_memory_optimization": True, "partition_activations": True},
     "contiguous_memory_optimization: true needs activation_checkpointing.number_checkpoints"),
    ({"policy": "some"}, "activation_checkpointing.policy"),
    ({"checkpoint_block": True}, "checkpoint_blocks"),
])
def test_config_mistakes_and_unbuilt_keys_name_the_key(section, words):
    with pytest.raises(schemas.ConfigError) as err:
        schemas.load_config({**BASE, "activation_checkpointing": section})
    assert words in str(err.value)


def test_contiguous_checkpointing_assertions_are_errors_in_configure_too():
    """DeepSpeed's two assertions, after the explicit arguments are applied; a refused call changes nothing."""
    with pytest.raises(ValueError, match=r"contiguous_checkpointing=\)\): true needs .*partition_activations"):
        ckpt.configure(contiguous_checkpointing=True, num_checkpoints=3)
    with pytest.raises(ValueError, match=r"needs activation_checkpointing.number_checkpoints \(configure\(num_check"):
        ckpt.configure(partition_activations=True, contiguous_checkpointing=True)
    assert not ckpt.is_configured() and not ckpt_settings.STATE.explicit
    section = {"partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 3}
    ckpt.configure(deepspeed_config={**BASE, "activation_checkpointing": section})
    assert ckpt_settings.STATE.settings.num_checkpoints == 3 and ckpt_settings.STATE.settings.contiguous_checkpointing


def _recording(api, log):
    """`api`, logging each block input: a weak reference to it (is it still held?) and a copy of it."""
    def call(block, h):
        log.append((weakref.ref(h), h.detach().clone()))
        return api(block, h)
    return call


@pytest.mark.parametrize("api", ["checkpoint", "non_reentrant_checkpoint"])
def test_contiguous_buffer_holds_the_saved_inputs_and_gradients_stay_identical(api):
    """One rank (a group of one): every checkpoint input is copied into slot k of one (slots, numel)
    buffer, the block inputs themselves are freed, gradients are bit-identical, a second step after
    backward fills a fresh buffer, and a third, whose buffer is overwritten before backward, shows
    that the recompute reads its inputs from the slots."""
    torch.manual_seed(0)
    plain = BlockNet(layers=3)
    x, y = torch.randn(6, 7), torch.randn(6, 3)
    want_loss, want = _loss_and_grads(plain, x, y)
    ckpt.configure(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=4)
    model = copy.deepcopy(plain)
    for step in range(3):
        log = []
        model.api = _recording(getattr(ckpt, api), log)
        torch.manual_seed(5)
        model.zero_grad(set_to_none=True)
        loss = model(x, y)
        (buffer,) = ckpt_contiguous.SLOTS.buffers()
        assert buffer.shape == (4, 6 * D) and buffer.device == x.device
        for k, (ref, copied) in enumerate(log):
            assert torch.equal(buffer[k], copied.reshape(-1)), f"step {step}: slot {k}"
            assert ref() is None, f"step {step}: block {k}'s input is still held whole"
        if step == 2:  # the recompute reads the slots: overwrite them and the gradients change
            buffer.fill_(0.5)
        loss.backward()
        assert torch.equal(loss.detach(), want_loss)
        same = {name: torch.equal(model.get_parameter(name).grad, g) for name, g in want.items()}
        if step < 2:
            assert all(same.values()), (step, same)
        else:  # what depends on the recomputed activations of block 0 (not, e.g., the head's gradient)
            assert not same["blocks.0.up.weight"] and not same["inp.weight"], same


def test_more_checkpoints_than_number_checkpoints_names_the_key():
    ckpt.configure(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    model = BlockNet(layers=3, api=ckpt.checkpoint)
    with pytest.raises(RuntimeError, match="activation_checkpointing.number_checkpoints: 2 slots are full"):
        model(torch.randn(6, 7), torch.randn(6, 3))


@pytest.mark.parametrize("api", ["checkpoint", "non_reentrant_checkpoint"])
def test_forwards_under_no_grad_hold_nothing_and_fill_no_slots(api):
    """Evaluation under torch.no_grad() has no backward: no input is partitioned, moved or copied into a
    slot, so any number of eval forwards run between training steps (the slots were full after two)."""
    ckpt.configure(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2,
                   checkpoint_in_cpu=True)
    model = BlockNet(layers=2, api=getattr(ckpt, api)).eval()
    x, y = torch.randn(6, 7), torch.randn(6, 3)
    with torch.no_grad(), ckpt.SavedActivationProbe(model.parameters()) as probe:
        losses = [model(x, y) for _ in range(3)]
    assert ckpt_contiguous.SLOTS.buffers() == [] and probe.peak_bytes == 0
    model.api = None
    with torch.no_grad():
        assert torch.equal(losses[0], model(x, y)) and torch.equal(losses[2], losses[0])
    model.api = getattr(ckpt, api)
    loss = model.train()(x, y)
    assert len(ckpt_contiguous.SLOTS.buffers()) == 1  # training still fills the slots
    loss.backward()


def test_reset_is_deepspeeds_the_buffers_go_and_the_configuration_stays():
    """Two forwards without a backward fill 2 x 2 slots; reset() between them, as DeepSpeed says for
    evaluation, makes room and keeps what configure() set."""
    ckpt.configure(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    model = BlockNet(layers=2, api=ckpt.checkpoint)
    x, y = torch.randn(6, 7), torch.randn(6, 3)
    model(x, y)
    with pytest.raises(RuntimeError, match="number_checkpoints: 2 slots are full"):
        model(x, y)
    ckpt.reset()
    assert ckpt.is_configured() and ckpt_settings.STATE.settings.contiguous_checkpointing
    model(x, y).backward()
    ckpt.unconfigure()
    assert not ckpt.is_configured()


def test_rng_tracker_refuses_a_second_stream_on_one_seed():
    tracker = ckpt.RNGStatesTracker()
    tracker.add("a", 7)
    with pytest.raises(ValueError, match="RNG seed 7 is used by another stream"):
        tracker.add("b", 7)


def test_unknown_module_class_names_the_key():
    with pytest.raises(ValueError, match="activation_checkpointing.checkpoint_module_classes.*Nope"):
        ckpt.checkpoint_blocks(BlockNet(), ActivationCheckpointingConfig(checkpoint_module_classes=["Nope"]))


def _pipeline_checkpoint_blocks() -> tuple[str, int]:
    """A PipelineModule (in a rank of its own: building one initialises a process group) under
    checkpoint_blocks (the error) and under checkpoint_module_classes naming a class it lacks (chosen)."""
    from engine.pipe import PipelineModule
    pipe = PipelineModule([torch.nn.Linear(4, 4) for _ in range(4)], num_stages=1, loss_fn=torch.nn.functional.mse_loss)
    try:
        ckpt.checkpoint_blocks(pipe, ActivationCheckpointingConfig(checkpoint_blocks=True))
        said = ""
    except ValueError as err:
        said = str(err)
    return said, len(ckpt.checkpoint_blocks(pipe, ActivationCheckpointingConfig(checkpoint_module_classes=["Linear",
                                                                                                           "GELU"])))


def test_checkpoint_blocks_that_finds_no_block_is_an_error_naming_the_key():
    """(apply.py's note: nothing found is an error) a model without a block list, and a PipelineModule,
    whose layers are registered one by one: the key would have saved nothing, silently."""
    from tests.harness import run_distributed
    flat = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))  # no one class
    with pytest.raises(ValueError, match="activation_checkpointing.checkpoint_blocks: the model has no"):
        ckpt.checkpoint_blocks(flat, ActivationCheckpointingConfig(checkpoint_blocks=True))
    said, chosen = run_distributed(_pipeline_checkpoint_blocks, 1, timeout=120)[0]
    assert "checkpoint_blocks finds no block list in a PipelineModule" in said and "interval" in said, said
    assert chosen == 4


def test_module_classes_choose_the_outermost_match():
    model = BlockNet()
    chosen = ckpt.checkpoint_blocks(model, ActivationCheckpointingConfig(checkpoint_module_classes=["Block",
                                                                                                  "Linear"]))
    assert set(map(id, chosen)) == {id(b) for b in model.blocks} | {id(model.inp), id(model.out)}


def _hf_model(kind: str, attn: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn))
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                        attn_implementation=attn))


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("kind,attn", [("gpt2", "eager"), ("gpt2", "sdpa"), ("llama", "sdpa")])
def test_hf_blocks_with_the_default_kv_cache_train_exactly(kind, attn, policy):
    """HF models make a KV cache in training by default (`use_cache=True`); a recompute appending to it
    again doubled the keys (apply.py's note on KV caches). Padded batches, as a user's are."""
    plain = _hf_model(kind, attn)
    checkpointed = copy.deepcopy(plain)
    ckpt.checkpoint_blocks(checkpointed, ActivationCheckpointingConfig(checkpoint_blocks=True, policy=policy))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[0, 11:] = 0
    grads = []
    for model in (plain, checkpointed):
        loss = model(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100)).loss
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # nothing is replayed without grad: the cache is filled, as generation needs
        assert checkpointed(input_ids=x).past_key_values.get_seq_length() == 16


# -- through initialize, ZeRO stages 0-3, 2 ranks -------------------------------------------------------
STEPS, MICRO, LR, SEED = 3, 2, 0.3, 1234
SECTIONS = {"full": {"checkpoint_blocks": True}, "selective": {"checkpoint_blocks": True, "policy": "selective"},
            "full-cpu": {"checkpoint_module_classes": ["Block"], "cpu_checkpointing": True},
            # no mpu from a config alone: a group of one, whose slices are the whole inputs, in the buffer
            "full-contiguous": {"checkpoint_blocks": True, "partition_activations": True,
                                "contiguous_memory_optimization": True, "number_checkpoints": 3},
            "selective_unpack": {"checkpoint_blocks": True, "policy": "selective_unpack"},
            "api-shared": {}}


def _batches(world: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(MICRO * world, 7, generator=g), torch.randn(MICRO * world, 3, generator=g))
            for _ in range(STEPS)]


def _model(case: str) -> BlockNet:
    torch.manual_seed(0)
    shared = case == "api-shared"
    return BlockNet(api=ckpt.checkpoint if shared else None, shared=shared)


def _train(stage: int, case: str) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = {**BASE, "seed": SEED, "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "zero_allow_untested_optimizer": True, "activation_checkpointing": SECTIONS[case],
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 10}}
    eng, _, _, _ = engine.initialize(model=_model(case), config=cfg)
    patched = sum("forward" in vars(m) for m in eng.module.modules())
    for x, y in _batches(world):
        eng.backward(eng(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
        eng.step()
    ckpt.unconfigure()
    return {"patched": patched, "params": {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()}}


class WorldMpu:
    """A tensor-parallel group of the whole world (Megatron's mpu interface)."""

    def get_model_parallel_group(self):
        return None

    def get_model_parallel_rank(self):
        return torch.distributed.get_rank()

    def get_model_parallel_world_size(self):
        return torch.distributed.get_world_size()


PARTITIONED = {"reentrant": ("checkpoint", {}), "reentrant-cpu": ("checkpoint", {"checkpoint_in_cpu": True}),
               "non_reentrant": ("non_reentrant_checkpoint", {}),
               "non_reentrant-cpu": ("non_reentrant_checkpoint", {"checkpoint_in_cpu": True}),
               "reentrant-contiguous": ("checkpoint", {"contiguous_checkpointing": True, "num_checkpoints": 4}),
               "non_reentrant-contiguous": ("non_reentrant_checkpoint",
                                            {"contiguous_checkpointing": True, "num_checkpoints": 4})}


def _partitioned(case: str) -> dict:
    """Replicated activations on a tensor-parallel group of 2: each rank keeps half of each saved input."""
    api, settings = PARTITIONED[case]
    torch.manual_seed(0)
    plain = BlockNet(layers=4, d_in=D)
    x, y = torch.randn(8, D), torch.randn(8, 3)
    want_loss, want = _loss_and_grads(plain, x, y)
    result = {}
    for partition in (False, True):
        if partition or "contiguous" not in case:
            ckpt.configure(mpu_=WorldMpu(), partition_activations=partition, **settings)
        model, log = copy.deepcopy(plain), []
        model.api = _recording(getattr(ckpt, api), log)
        torch.manual_seed(5)
        with ckpt.SavedActivationProbe(model.parameters()) as probe:
            loss = model(x, y)
            held = probe.live_bytes
            alive = sum(ref() is not None for ref, _ in log)
            buffers = [b.clone() for b in ckpt_contiguous.SLOTS.buffers()]
            rank = torch.distributed.get_rank()
            slots_hold_my_halves = bool(buffers) and all(
                torch.equal(buffers[0][k], copied.reshape(-1).chunk(2)[rank]) for k, (_, copied) in enumerate(log))
            loss.backward()
        exact = torch.equal(loss.detach(), want_loss) and all(torch.equal(p.grad, want[n])
                                                              for n, p in model.named_parameters())
        result[partition] = {"exact": exact, "held": held, "alive": alive, "buffers": [b.shape for b in buffers],
                             "slots_hold_my_halves": slots_hold_my_halves}
        ckpt.unconfigure()
    return result


def _all_cases() -> dict:
    out = {(stage, case): _train(stage, case) for stage in (0, 1, 2, 3) for case in SECTIONS}
    out["partition"] = {case: _partitioned(case) for case in PARTITIONED}
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_cases, 2, timeout=240)


@functools.lru_cache(maxsize=None)
def _reference(shared: bool, world: int = 2) -> dict:
    """Single process, no checkpointing, each rank's micro-batch drawn on that rank's RNG stream
    (initialize seeds rank r with seed + r), gradients averaged over the ranks, plain SGD. Every
    case trains the same model but "api-shared" (a block reached twice): two references."""
    model = _model("api-shared" if shared else "full")
    model.api = None
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    streams = [torch.Generator().manual_seed(SEED + r).get_state() for r in range(world)]
    for x, y in _batches(world):
        for r in range(world):
            torch.set_rng_state(streams[r])
            (model(x[r * MICRO:(r + 1) * MICRO], y[r * MICRO:(r + 1) * MICRO]) / world).backward()
            streams[r] = torch.get_rng_state()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("case", list(SECTIONS))
def test_initialize_applies_the_section_and_training_is_exact(runs, stage, case):
    ref = _reference(case == "api-shared")
    for rank, result in enumerate(runs):
        got = result[(stage, case)]
        # "selective_unpack" runs the model's own forward as a region too (apply.py): 3 blocks and the model
        want_patched = {"api-shared": 0, "selective_unpack": 4}.get(case, 3)
        assert got["patched"] == want_patched, "the section did not checkpoint the blocks"
        for name, want in ref.items():
            err = (got["params"][name] - want).abs().max().item()
            assert err < 2e-6, f"rank {rank} {name}: max |w - w_ref| = {err:.2e}"


@pytest.mark.parametrize("case", list(PARTITIONED))
def test_partition_activations_keeps_half_and_stays_exact(runs, case):
    half = 8 * D * 4 // 2  # a rank keeps half of each 8 x D fp32 block input
    for rank, result in enumerate(runs):
        whole, halves = result["partition"][case][False], result["partition"][case][True]
        assert whole["exact"] and halves["exact"], f"rank {rank}"
        # the checkpoint holds each block input whole without partitioning (a host copy of it with
        # cpu_checkpointing), only the slice with it
        held_whole = 0 if case.endswith("-cpu") else 4
        assert (whole["alive"], halves["alive"]) == (held_whole, 0), (rank, whole["alive"], halves["alive"])
        if "contiguous" in case:  # one (4 slots, half) buffer, slot k = this rank's half of block k's input
            assert halves["buffers"] == [(4, 8 * D // 2)] and halves["slots_hold_my_halves"], (rank, halves)
        # what the checkpoints hold for backward (4 slices, or the 4 slots of the buffer), by the probe
        assert whole["held"] - halves["held"] == 4 * half, (rank, halves, whole)


def test_the_probe_counts_each_saved_storage_once_and_releases_it():
    x = torch.randn(1000, requires_grad=True)
    w = nn.Parameter(torch.randn(1000))
    with ckpt.SavedActivationProbe([w]) as probe:
        y = x.exp()  # saves its output: 4000 bytes
        z = (y * y * w).sum()  # y saved (same storage: not again); w is a parameter: not counted
        assert probe.live_bytes == 4000 + 4000  # y, and y * y (saved by the product with w)
        z.backward()
        del y, z
    assert probe.peak_bytes == 8000 and probe.live_bytes == 0


def test_from_engine_checkpointing_import_works():
    from engine.checkpointing import checkpoint, configure, non_reentrant_checkpoint  # noqa: F401
    assert engine.checkpointing.checkpoint is checkpoint
