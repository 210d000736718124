"""The gradient-noise estimator of benchmarks/bench_grad_noise.py recovers a known signal fraction."""

from __future__ import annotations

import pytest
import torch

BENCHMARK = "bench_grad_noise"  # benchmarks/bench_grad_noise.py, the `bench` fixture (conftest.py)


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


def test_noise_decomposition_recovers_sample_and_forward_parts(bench):
    # g_i = s + n_sample + (1/k)·Σ_k n_forward: the noise energy is N_s + N_f/k; the estimator sees only G
    K, P, n_s, n_f = 48, 100_000, 0.006, 0.08
    g = torch.Generator().manual_seed(1)
    s = torch.randn(P, generator=g, dtype=torch.float64)
    s = s / s.norm() * 0.05
    energies = {}
    for k in (3, 9):
        G = s + torch.randn(K, P, generator=g, dtype=torch.float64) * (n_s / P) ** 0.5
        G = G + sum(torch.randn(K, P, generator=g, dtype=torch.float64) * (n_f / P) ** 0.5 for _ in range(k)) / k
        st = bench.noise_stats(G, B=64)
        energies[k] = (1 - st["rho"]) * float((G * G).sum(1).mean())
    got_s, got_f = bench.noise_decomposition(3, energies[3], 9, energies[9])
    assert got_f == pytest.approx(n_f, rel=0.1)
    assert got_s == pytest.approx(n_s, abs=0.003)
    assert bench.noise_decomposition(3, 0.0321, 9, 0.01492) == pytest.approx((0.00633, 0.07731))
    with pytest.raises(ValueError, match="two different"):
        bench.noise_decomposition(3, 1.0, 3, 1.0)
