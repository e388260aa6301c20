"""`dstrain ckpt consolidate` and `dstrain ckpt info`: checkpoints as plain files and as a summary.

consolidate writes one state dict with the module's own keys (tied weights under every name) that
`model.load_state_dict` takes without dstrain: DeepSpeed's zero_to_fp32 use case, for any stage and
world size. [Note: streaming] Each tensor is assembled from its fragments (reader.py), cast, and
written before the next is read: safetensors output is written directly (header first, sizes are
known from metadata.json); .pt output is filled into a file-backed (mmap) buffer per dtype, so only
one parameter at a time is held in anonymous memory, and then serialized by torch.save.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import torch

from . import format as fmt
from .reader import FragmentSource

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


def tag_dir(ckpt_dir, tag: str | None) -> Path:
    ckpt_dir = Path(ckpt_dir)
    source = f"--tag {tag!r}" if tag else f"{ckpt_dir / fmt.LATEST} (the `latest` pointer)"
    tag = tag or fmt.read_latest(ckpt_dir)
    if tag is None:
        raise fmt.CheckpointError(f"{ckpt_dir}: no `latest` file; pass --tag (tags: "
                                  f"{', '.join(fmt.committed_tags(ckpt_dir)) or 'none'})")
    path = fmt.tag_path(ckpt_dir, tag, source)
    if not (path / fmt.MANIFEST).exists():
        raise fmt.CheckpointError(f"{path}: not a committed checkpoint (no {fmt.MANIFEST})")
    return path


def verify_all(path: Path) -> dict[str, str | None]:
    """file -> None (ok) or the problem, for every file of the manifest."""
    manifest = fmt.read_json(path / fmt.MANIFEST)
    return {name: fmt.check_file(path / name, entry) for name, entry in sorted(manifest["files"].items())}


class _Plan:
    """Output keys in state_dict order: (key, source name, dtype, shape)."""

    def __init__(self, src: FragmentSource, dtype: torch.dtype):
        self.items = []
        aliases = src.meta["aliases"]
        for key in src.meta["state_dict_keys"]:
            name = aliases.get(key, key)
            if name not in src.params:
                continue
            entry = src.params[name]
            saved = src.dtypes[name]
            out = dtype if saved.is_floating_point else saved
            self.items.append((key, name, out, list(entry["shape"])))

    def tensor(self, src: FragmentSource, name: str, dtype: torch.dtype) -> torch.Tensor:
        return src.full(name, src.weights_kind(name)).to(dtype)


def consolidate(ckpt_dir, out, tag: str | None = None, safetensors: bool = False, dtype: str = "fp32") -> Path:
    path = tag_dir(ckpt_dir, tag)
    bad = {n: p for n, p in verify_all(path).items() if p}
    if bad:
        name, problem = next(iter(bad.items()))
        raise fmt.CheckpointError(f"checkpoint file {path / name}: {problem}")
    src = FragmentSource(path)
    plan = _Plan(src, DTYPES[dtype])
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    (_write_safetensors if safetensors else _write_torch)(src, plan, tmp)
    os.replace(tmp, out)
    return out


def _write_safetensors(src: FragmentSource, plan: _Plan, out: Path) -> None:
    header, offset = {}, 0
    for key, _, dtype, shape in plan.items:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _ST_DTYPE[dtype], "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt", "source": f"dstrain {src.path.name}"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8 bytes
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for key, name, dtype, _ in plan.items:
            t = plan.tensor(src, name, dtype).contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        f.flush()
        os.fsync(f.fileno())


def _write_torch(src: FragmentSource, plan: _Plan, out: Path) -> None:
    sizes: dict[torch.dtype, int] = {}
    for _, _, dtype, shape in plan.items:
        sizes[dtype] = sizes.get(dtype, 0) + torch.Size(shape).numel()
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        buffers = {dt: torch.from_file(os.path.join(scratch, str(dt)), shared=True, size=max(n, 1), dtype=dt)
                   for dt, n in sizes.items()}
        used = dict.fromkeys(sizes, 0)
        state, by_name = {}, {}
        for key, name, dtype, shape in plan.items:
            if name in by_name:  # tied weights: the same tensor under both keys, as the module has it
                state[key] = by_name[name]
                continue
            n = torch.Size(shape).numel()
            view = buffers[dtype][used[dtype]:used[dtype] + n].view(shape)
            view.copy_(plan.tensor(src, name, dtype).reshape(shape))
            used[dtype] += n
            state[key] = by_name[name] = view
        torch.save(state, out)


def _grid(meta: dict) -> str:
    """" (pipe P × data D × model M)" for a checkpoint saved with a pipe or model axis (placement.py)."""
    if meta.get("pipe_parallel_size", 1) == 1 and meta.get("model_parallel_size", 1) == 1:
        return ""
    return f" (pipe {meta['pipe_parallel_size']} × data {meta['data_parallel_size']} × model {meta['model_parallel_size']})"


def info(ckpt_dir, verify: bool = True) -> tuple[str, bool]:
    """A summary of every tag (world size, stage, precision, step, size, checksum status), and whether
    every tag read and checked cleanly."""
    ckpt_dir = Path(ckpt_dir)
    latest, lines, healthy = fmt.read_latest(ckpt_dir), [], True
    for tag in fmt.committed_tags(ckpt_dir):
        path = ckpt_dir / tag
        try:
            meta = fmt.read_json(path / fmt.METADATA)
            manifest = fmt.read_json(path / fmt.MANIFEST)
        except fmt.CheckpointError as e:
            lines.append(f"{tag}: unreadable: {e}")
            healthy = False
            continue
        size = sum(e["bytes"] for e in manifest["files"].values())
        status = "not checked"
        if verify:
            bad = {n: p for n, p in verify_all(path).items() if p}
            status = "ok" if not bad else "; ".join(f"{n}: {p}" for n, p in bad.items())
            healthy = healthy and not bad
        lines.append(f"{tag}{' (latest)' if tag == latest else ''}: step {meta['counters']['global_steps']}, "
                     f"world size {meta['world_size']}{_grid(meta)}, ZeRO stage {meta['zero_stage']}, {meta['precision']}, "
                     f"{len(meta['params'])} tensors, {len(manifest['files'])} files, {size / 2**20:.2f} MiB, "
                     f"checksums {status}")
    for d in sorted(ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []:
        if fmt.is_tmp_dir(d):
            lines.append(f"{d.name}: incomplete save (ignored by loading; removed by the next save)")
    if latest is not None and latest not in fmt.committed_tags(ckpt_dir):
        lines.append(f"latest names {latest!r}, which is not a committed tag")
    return ("\n".join(lines) if lines else f"{ckpt_dir}: no checkpoints"), healthy
