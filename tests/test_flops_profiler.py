"""FLOPs profiler and MFU (engine/profiling): counts at the dispatcher equal the analytic counts, for
Linear layers, `@` matmuls and SDPA; the GPT's counted FLOPs agree with 6N + 12·L·H·Q·T; the
`flops_profiler` section prints the per-module profile at its step; MFU arithmetic and peaks."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.profiling import get_model_profile
from engine.profiling.mfu import transformer_train_flops_per_token, utilisation
from engine.profiling.peaks import cpu_peak_flops, gpu_peak_tflops, peak_flops_per_device
from examples.gpt import GPT, GPTConfig
from tests.harness import run_distributed
from tests.models import OddMLP


class MatmulAttention(nn.Module):
    """A projection written with `@` and attention through SDPA: what module-patching profilers miss."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, 3 * d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (x @ self.w).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v).sum()


def test_linear_layers_count_exactly_two_flops_per_mac(tmp_path):
    model = nn.Sequential(nn.Linear(13, 37, bias=False), nn.ReLU(), nn.Linear(37, 5, bias=False))
    out = tmp_path / "profile.txt"
    flops, macs, params = get_model_profile(model, input_shape=(8, 13), print_profile=True, as_string=False,
                                            output_file=str(out))
    assert flops == 2 * 8 * (13 * 37 + 37 * 5)
    assert macs == flops // 2 and params == 13 * 37 + 37 * 5
    text = out.read_text()
    assert "0 (Linear)" in text and "2 (Linear)" in text and "1 (ReLU)" in text  # the per-module tree
    assert get_model_profile(model, input_shape=(8, 13), print_profile=False) == ("10.66 KFLOPS", "5.33 KMACs", "666")


def test_at_matmuls_and_sdpa_are_counted():
    b, t, d, h = 2, 10, 16, 2
    flops, _, _ = get_model_profile(MatmulAttention(d, h), args=[torch.randn(b, t, d)], print_profile=False,
                                    as_string=False)
    projection = 2 * b * t * d * 3 * d
    attention = 2 * (2 * b * h * t * t * (d // h))  # QK^T and AV
    assert flops == projection + attention


def test_gpt_counted_flops_agree_with_the_transformer_formula():
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=128)
    model = GPT(cfg)
    b = 2
    idx = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len))
    fwd, _, _ = get_model_profile(model, args=[idx], print_profile=False, as_string=False)
    counted_train_per_token = 3 * fwd / (b * cfg.seq_len)
    n = sum(p.numel() for p in model.parameters())
    analytic = transformer_train_flops_per_token(n, cfg.n_layer, cfg.n_head, cfg.d_model // cfg.n_head, cfg.seq_len)
    assert counted_train_per_token == pytest.approx(analytic, rel=0.03)


class _Inner(nn.Module):
    """A matmul of its own (`@`) and a Linear child: what DeepSpeed's `ignore_modules` moves and keeps."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d))
        self.lin = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.lin(x @ self.w)


class _Outer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d))
        self.inner = _Inner(d)

    def forward(self, x):
        return self.inner(x @ self.w)


def test_ignore_modules_moves_their_own_flops_to_the_parent_as_deepspeed():
    """DeepSpeed 0.19.8 hooks no module of an ignored type: its own operations count in the nearest
    profiled ancestor, its submodules keep their rows, totals and parameter counts do not change
    (measured there on this model, d 8, batch 3: total 1152 both ways, `inner` 768 -> 384)."""
    from engine.profiling.module_profile import ModuleProfile
    b, d = 3, 8
    model, x = _Outer(d), torch.randn(b, d)
    matmul = 2 * b * d * d
    with ModuleProfile(model) as plain:
        model(x)
    with ModuleProfile(model, (_Inner,)) as prof:
        model(x)
    assert plain.stats["inner"].flops == 2 * matmul and plain.stats["inner.lin"].flops == matmul
    assert prof.total_flops == plain.total_flops == 3 * matmul and prof.total_params == 3 * d * d
    assert prof.stats["inner"].flops == matmul  # only its Linear's: its own `@` went to the root
    assert prof.stats["inner.lin"].flops == matmul and prof.stats[""].flops == 3 * matmul
    assert prof.stats["inner"].latency_s == prof.stats["inner.lin"].latency_s
    with ModuleProfile(model, (_Outer,)) as root:  # an ignored root: nothing profiled to count its `@` in
        model(x)
    assert root.total_flops == 2 * matmul and root.stats[""].flops == 2 * matmul
    full = get_model_profile(model, args=[x], print_profile=False, as_string=False)
    assert get_model_profile(model, args=[x], print_profile=False, as_string=False,
                             ignore_modules=[nn.Linear, _Inner]) == full
    with pytest.raises(TypeError, match="ignore_modules"):
        get_model_profile(model, args=[x], print_profile=False, ignore_modules=["_Inner"])


def _profiled_training(out: str):
    import engine
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "flops_profiler": {"enabled": True, "profile_step": 2, "module_depth": -1, "top_modules": 2,
                              "detailed": True, "output_file": str(Path(out) / "flops.txt")},
           "mfu": {"peak_tflops": 1.0}}
    path = Path(out) / f"cfg{os.environ['RANK']}.json"
    path.write_text(json.dumps(cfg))
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=str(path))
    for _ in range(3):
        x, y = torch.randn(4, 13), torch.randn(4, 5)
        eng.backward(eng(x, y))
        eng.step()
    eng.destroy()
    return eng.metrics.fwd_flops_per_sample


def test_the_flops_profiler_section_prints_the_profile_at_its_step(tmp_path):
    per_sample = run_distributed(_profiled_training, 1, args=(str(tmp_path),), timeout=90)
    expected = 2 * (13 * 37 + 37 * 37 + 37 * 5)
    assert per_sample == [expected]
    text = (tmp_path / "flops.txt").read_text()
    assert "profile at step:" in text and text.split("profile at step:")[1].split()[0] == "2"
    fwd_line = next(line for line in text.splitlines() if line.startswith("fwd FLOPs per rank"))
    assert fwd_line.split(":")[1].split() == [f"{4 * expected / 1e3:.2f}", "K"]
    for module in ("l1 (Linear)", "l2 (Linear)", "l3 (Linear)", "backward latency", "step latency"):
        assert module in text


def _profiled_by_keyword(out: str):
    import engine
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": str(Path(out) / "flops.txt")}}
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=cfg)
    eng.backward(eng(x=torch.randn(4, 13), y=torch.randn(4, 5)))
    eng.step()
    eng.destroy()
    return eng.metrics.fwd_flops_per_sample


def test_a_model_called_by_keyword_is_profiled_with_the_first_keyword_tensor_as_batch(tmp_path):
    per_sample = run_distributed(_profiled_by_keyword, 1, args=(str(tmp_path),), timeout=90)
    assert per_sample == [2 * (13 * 37 + 37 * 37 + 37 * 5)]
    assert "profile at step:" in (tmp_path / "flops.txt").read_text()


def test_mfu_arithmetic():
    u = utilisation(fwd_flops_per_sample=1e9, samples_per_s_per_device=100.0, peak_flops=1e12,
                    recompute_fwd_factor=1.0)
    assert u.tflops == pytest.approx(0.3) and u.mfu == pytest.approx(0.3) and u.hfu == pytest.approx(0.4)
    assert utilisation(1e9, 100.0, None).mfu is None
    assert transformer_train_flops_per_token(1000, 2, 4, 8, 16) == 6 * 1000 + 12 * 2 * 4 * 8 * 16


def test_peaks_table_config_and_cached_cpu_measurement(tmp_path):
    assert gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0 and gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert gpu_peak_tflops("NVIDIA H200") == 989.4 and gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops("Some New GPU") is None
    assert peak_flops_per_device(torch.device("cpu"), 2.5) == (2.5e12, "mfu.peak_tflops")
    cache = tmp_path / "peak.json"
    first = cpu_peak_flops(cache)
    assert first > 0 and cache.exists()
    table = json.loads(cache.read_text())
    table = {k: 123.0 for k in table}  # the cached figure is what a second call returns: measured once
    cache.write_text(json.dumps(table))
    assert cpu_peak_flops(cache) == 123.0


def _initialize_with_output_file(output_file: str):
    import engine
    import schemas
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "flops_profiler": {"enabled": True, "output_file": output_file}}
    try:
        engine.initialize(model=OddMLP(), config=cfg)
    except schemas.ConfigError as err:
        return str(err)
    return "accepted"


def test_an_output_file_in_a_missing_directory_is_refused_at_initialize(tmp_path):
    missing = str(tmp_path / "absent" / "flops.txt")
    assert run_distributed(_initialize_with_output_file, 1, args=(missing,), timeout=90) == [
        f"flops_profiler.output_file: {missing!r} is in a directory that does not exist: "
        f"create {tmp_path / 'absent'} (or leave output_file unset to print the profile)"]
