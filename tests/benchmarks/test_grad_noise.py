"""The gradient-noise estimator of benchmarks/bench_grad_noise.py recovers a known signal fraction."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_grad_noise.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_grad_noise", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("rho_true", [0.0, 0.05, 0.5])
def test_signal_fraction_recovers_known_rho(bench, rho_true):
    # g_i = s + n_i with |s|² = ρ and E|n_i|² = 1 − ρ (isotropic in P dims): ρ = |s|² / E|g|²
    K, P = 32, 200_000
    g = torch.Generator().manual_seed(0)
    s = torch.randn(P, generator=g, dtype=torch.float64)
    s = s / s.norm() * rho_true**0.5
    n = torch.randn(K, P, generator=g, dtype=torch.float64) * ((1 - rho_true) / P) ** 0.5
    st = bench.noise_stats(s + n, B=64)
    assert st["rho"] == pytest.approx(rho_true, abs=max(4 * st["rho_se"], 2e-3))
    assert st["rho_se"] < 0.05
    if rho_true > 0:
        assert st["B_noise"] == pytest.approx(64 * (1 / rho_true - 1), rel=0.2)


def test_identical_gradients_are_all_signal(bench):
    G = torch.randn(1, 1000, dtype=torch.float64).repeat(5, 1)
    st = bench.noise_stats(G, B=8)
    assert st["rho"] == pytest.approx(1.0) and st["B_noise"] == pytest.approx(0.0, abs=1e-9)
    assert st["cos_with_rest"] == pytest.approx(1.0)
