"""benchmarks/step_credit_figures.py: the per-trajectory definitions on hand-made reward sequences, and one tiny
end-to-end run on the shipped model."""

from __future__ import annotations

import math

import numpy as np

BENCHMARK = "step_credit_figures"  # the `bench` fixture (conftest.py)


def test_decided_step_is_the_first_step_after_which_strict_never_changes(bench):
    assert bench.decided_step(np.array([1, 1, 1, 1])) == 0  # right from the estimate of x_T on
    assert bench.decided_step(np.array([0, 1, 0, 1, 1])) == 3
    assert bench.decided_step(np.array([1, 1, 0])) == 2  # lost only at x0: decided at the last step
    assert bench.decided_step(np.array([0, 0, 1, 0, 0])) == 3


def test_dips_count_only_beyond_the_reward_noise_and_strict_flips_only_right_to_wrong(bench):
    sigma = 0.05  # a dip must exceed 2·√2·σ ≈ 0.1414
    rho = np.array([
        [0.2, 0.5, 0.45, 0.6, 0.7],  # wiggle of 0.05 < 0.1414: naive non-monotone, no dip
        [0.2, 0.6, 0.4, 0.6, 0.7],   # falls 0.2 below its running max 0.6: a dip
        [0.1, 0.2, 0.3, 0.4, 0.5],   # monotone
        [0.9, 0.8, 0.7, 0.6, 0.5],   # only falls: 0.4 below the start, a dip, but never rises (not naive)
    ])
    strict = np.array([[0, 0, 0, 1, 1], [0, 1, 0, 0, 1], [0, 0, 0, 0, 0], [1, 1, 0, 1, 0]])
    f = bench.analyse(rho, strict, sigma)
    assert f["naive"].tolist() == [True, True, False, False]
    assert f["dense_dip"].tolist() == [False, True, False, True]
    assert f["strict_flip"].tolist() == [False, True, False, True]
    assert f["decided"].tolist() == [3, 4, 0, 4]
    assert 2 * math.sqrt(2) * sigma < 0.2


def test_tiny_run_on_the_shipped_model(bench, tmp_path):
    s = bench.main(["--per-tag", "1", "--group", "2", "--substeps", "2", "--threads", "1", "--out", str(tmp_path)])
    T = s["steps"]
    assert s["samples"] == 12 and T == 10 and len(s["by_tag"]) == 6
    a = s["all"]
    assert sum(a["decided_hist"]) == 12 and len(a["gain_abs_per_step"]) == T and s["sigma_dense"] >= 0
    assert len(s["sigma_dense_per_state"]) == T + 1 and 0 <= a["dense_dip"] <= 1
    assert s["nfe_estimates"] > 0 and s["t_grid"][0] == 1.0 and s["t_grid"][-1] == 0.0
    assert (tmp_path / "report.md").read_text().startswith("## Intermediate rewards")
