"""Checkpoint I/O paths: what a rank file holds (a few storages covering just the fragments:
snapshot.py's note: packing), loading into existing optimizer state, and write blocks reused from
file to file.

`pack` on views of a padded flat (one run with gaps), a scalar shared by several keys, a strided and
an empty tensor, a second dtype: values kept; without an arena the results alias the live memory
through storages of exactly their run's bytes (torch.save writes whole storages); with one they are
copies, in buffers the next pack reuses. At every stage (2 ranks), a sync and an async save of the same
state write equal tensors, no more bytes than the fragments (at stage 0 saving the views wrote each
parameter whole on every rank), and the async one (one storage per dtype) loads back exactly, into a
fresh engine and into one that has optimizer state (stages 1-3 load into its buffers). The block
writer's pooled blocks write each file's own bytes.
"""
from __future__ import annotations

import io
import tempfile
from pathlib import Path

import pytest
import torch

import engine
from engine.checkpoint.snapshot import Arena, pack
from tests.harness import run_distributed


def _live() -> tuple[torch.Tensor, dict]:
    flat = torch.arange(10000, dtype=torch.float32)
    step = torch.tensor(3.0)
    tensors = {"a": flat[0:10].view(2, 5), "b": flat[12:30], "c": flat[30:31].view(()), "far": flat[9000:9005],
               "s1": step, "s2": step, "t": torch.arange(6.0).view(2, 3).t(), "e": flat[40:40],
               "h": torch.arange(4, dtype=torch.float16), "n": 7}
    return flat, tensors


def _saved_bytes(tensors: dict) -> int:
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return len(buf.getvalue())


def test_pack_views_cover_only_the_fragments():
    flat, live = _live()
    out = pack(live)
    for key, value in live.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(out[key], value) and out[key].shape == value.shape, key
    assert out["n"] == 7
    assert out["a"].data_ptr() == flat.data_ptr() and out["b"].data_ptr() == live["b"].data_ptr()  # no copy
    assert out["a"].untyped_storage().nbytes() == 31 * 4  # a, b, c: one run, the gap 10:12 inside it
    assert out["far"].untyped_storage().nbytes() == 5 * 4  # too far away to join it
    assert out["s1"].untyped_storage().data_ptr() == out["s2"].untyped_storage().data_ptr()
    assert _saved_bytes(out) < _saved_bytes(live) - 9000 * 4  # the rest of the flat stays out


def test_pack_into_arena_copies_and_reuses():
    flat, live = _live()
    arena = Arena()
    out = pack(live, arena)
    flat.add_(1000)  # training goes on: the snapshot must not change
    _, again = _live()
    for key, value in again.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(out[key], value), key
    fp32 = {out[k].untyped_storage().data_ptr() for k in ("a", "b", "c", "far", "s1", "s2")}
    assert len(fp32) == 1  # one storage per dtype
    first = out["a"].data_ptr()
    out2 = pack(again, arena)
    assert out2["a"].data_ptr() == first  # the same buffer, not a fresh allocation
    assert torch.equal(out2["b"], again["b"])


def _config(stage: int, async_save: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage}, "checkpoint": {"async_save": async_save}}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 255), torch.nn.Linear(255, 256))
    model.register_buffer("counts", torch.randint(0, 100, (10,)))
    return model


def _save_both(root: str, stage: int):
    root = Path(root) / f"stage{stage}"
    eng, _, _, _ = engine.initialize(model=_model(0), config=_config(stage, True))
    for _ in range(2):
        eng.backward(eng(torch.randn(1, 256)).square().sum())
        eng.step()
    ckpt = eng.checkpoint_io
    ckpt.cfg = ckpt.cfg.model_copy(update={"async_save": False})
    eng.save_checkpoint(root, tag="sync")
    ckpt.cfg = ckpt.cfg.model_copy(update={"async_save": True})
    eng.save_checkpoint(root, tag="async")
    eng.save_checkpoint(root, tag="async2")  # reuses the arena (waits for the first)
    eng.wait_for_checkpoint()
    with engine.zero.GatheredParameters(list(eng.module.parameters())):
        weights = {k: v.clone() for k, v in eng.module.state_dict().items()}
    fresh, _, _, _ = engine.initialize(model=_model(1), config=_config(stage, False))
    fresh.load_checkpoint(root, tag="async2")
    with engine.zero.GatheredParameters(list(fresh.module.parameters())):
        loaded = {k: v.clone() for k, v in fresh.module.state_dict().items()}
    eng.backward(eng(torch.randn(1, 256)).square().sum())
    eng.step()  # the state moves on; loading puts it back, into the same buffers at stages 1-3
    before = _optimizer_tensors(eng)  # held: a new buffer cannot take their addresses
    eng.load_checkpoint(root, tag="async2")
    reused = [t.data_ptr() for t in _optimizer_tensors(eng)] == [t.data_ptr() for t in before]
    same = all(torch.equal(a, b) for a, b in zip(_optimizer_tensors(eng), _optimizer_tensors(fresh)))
    return weights, loaded, same and len(before) == len(_optimizer_tensors(fresh)), reused


def _optimizer_tensors(eng) -> list[torch.Tensor]:
    opt = eng.zero_optimizer.optimizer
    return [v for g in opt.param_groups for p in g["params"] for v in opt.state.get(p, {}).values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sync_and_async_rank_files_hold_just_the_fragments(stage):
    with tempfile.TemporaryDirectory() as root:
        for weights, loaded, same, reused in run_distributed(_save_both, 2, args=(root, stage), timeout=120):
            for key, value in weights.items():
                assert torch.equal(loaded[key], value), key
            assert same, "loading into an engine with optimizer state differs from loading into a fresh one"
            assert reused or stage == 0
        tags = Path(root) / f"stage{stage}"
        for rank in range(2):
            name = f"rank_{rank:05d}.pt"
            files = {tag: torch.load(tags / tag / name, weights_only=True) for tag in ("sync", "async", "async2")}
            sync, asyn = files["sync"]["tensors"], files["async"]["tensors"]
            assert sync.keys() == asyn.keys() == files["async2"]["tensors"].keys()
            for key in sync:
                assert torch.equal(sync[key], asyn[key]), key
                assert torch.equal(asyn[key], files["async2"]["tensors"][key]), key
            dtypes = {t.dtype for t in asyn.values()}
            assert len({t.untyped_storage().data_ptr() for t in asyn.values()}) == len(dtypes)
            fragment_bytes = sum(t.numel() * t.element_size() for t in sync.values())
            for tag in ("sync", "async"):
                size = (tags / tag / name).stat().st_size
                assert size <= fragment_bytes + 32768, f"{tag} {name}: {size} bytes for {fragment_bytes} of fragments"
                # (+ RNG states, pickle and zip headers; a whole-parameter save at stage 0 doubled it)


def test_write_blocks_are_reused_and_write_the_same_bytes(tmp_path, monkeypatch):
    """Blocks go back to a pool when a file is closed and the next file takes them: it must write its own
    bytes, not the previous file's leftovers (the tail of a block is not cleared)."""
    import hashlib
    from engine.checkpoint import blockio
    monkeypatch.setattr(blockio, "BLOCK", 1 << 16)
    monkeypatch.setattr(blockio, "_POOL", [])
    g = torch.Generator().manual_seed(1)
    taken = []
    for n, name in ((300_001, "x"), (70_000, "y")):
        data = bytes(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).tolist())
        f = blockio.HashingFile(tmp_path / name)
        taken.append({id(b) for b in f._bufs})
        for at in range(0, len(data), 100_000):
            f.write(data[at:at + 100_000])
        assert f.close() == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        assert (tmp_path / name).read_bytes() == data
    assert taken[0] == taken[1]  # the second file wrote through the first one's blocks
