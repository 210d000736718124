"""Statistics of `flowcredit compare` on synthetic curves with hand-computed answers."""

import math

import numpy as np
import pytest

from flowcredit.compare.stats import (
    final_mean_ci, mean_band, paired_difference, ratio, summarize_times, t_quantile, time_to_target,
)


def test_mean_band_hand_computed():
    # three seeds, constant curves 1, 2, 3 → mean 2, sd 1, half-width t(2)·1/√3 = 4.303/1.732 = 2.4843
    grid = np.linspace(0, 10, 11)
    curves = [([0, 10], [v, v]) for v in (1.0, 2.0, 3.0)]
    b = mean_band(curves, grid)
    assert np.allclose(b["mean"], 2.0)
    assert np.allclose(b["hi"] - b["mean"], 4.303 / math.sqrt(3), atol=1e-6)
    assert np.allclose(b["mean"] - b["lo"], 4.303 / math.sqrt(3), atol=1e-6)
    assert (b["n"] == 3).all()


def test_mean_band_interpolates_and_handles_partial_coverage():
    grid = np.array([0.0, 5.0, 10.0, 20.0])
    curves = [([0, 10], [0.0, 1.0]), ([0, 20], [0.0, 2.0])]  # second seed ran longer
    b = mean_band(curves, grid)
    assert b["n"].tolist() == [2, 2, 2, 1]
    assert np.isclose(b["mean"][1], (0.5 + 0.5) / 2)  # both are 0.5 at x=5
    assert np.isclose(b["mean"][2], (1.0 + 1.0) / 2)
    assert np.isclose(b["mean"][3], 2.0) and b["lo"][3] == b["hi"][3] == 2.0  # one seed: no band


def test_mean_band_all_seeds_stops_where_the_shortest_seed_ends():
    grid = np.array([0.0, 5.0, 10.0, 15.0, 20.0])
    curves = [([0, 10], [0.0, 1.0]), ([0, 20], [0.0, 2.0]), ([0, 12], [0.0, 1.2])]
    b = mean_band(curves, grid, all_seeds=True)
    assert b["n"].tolist() == [3, 3, 3, 1, 1]
    assert np.isclose(b["mean"][2], 1.0) and np.isfinite(b["lo"][2])
    assert np.isnan(b["mean"][3:]).all() and np.isnan(b["lo"][3:]).all() and np.isnan(b["hi"][3:]).all()
    full = mean_band(curves, grid)  # the default keeps the partial points
    assert np.isfinite(full["mean"]).all() and np.isclose(full["mean"][3], 1.5)  # the 20-long seed alone


def test_time_to_target_interpolates_and_never():
    x = [0, 10, 20, 30]
    y = [0.1, 0.2, 0.4, 0.5]
    assert time_to_target(x, y, 0.3) == pytest.approx(15.0)  # halfway between 0.2 (x=10) and 0.4 (x=20)
    assert time_to_target(x, y, 0.05) == 0.0  # reached at the first point
    assert time_to_target(x, y, 0.6) is None  # never reached
    assert time_to_target(x, [0.1, 0.3, 0.2, 0.3], 0.3) == pytest.approx(10.0)  # first crossing counts


def test_summaries_and_ratios():
    s = summarize_times([10.0, None, 20.0])
    assert s == {"mean": 15.0, "reached": 2, "seeds": 3}
    assert summarize_times([None, None])["mean"] is None
    assert ratio(15.0, 30.0) == 0.5
    assert ratio(None, 30.0) is None and ratio(15.0, None) is None and ratio(1.0, 0.0) is None
    m, h = final_mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and h == pytest.approx(4.303 / math.sqrt(3))
    assert final_mean_ci([5.0]) == (5.0, 0.0)
    assert t_quantile(1) == pytest.approx(12.706) and t_quantile(100) == pytest.approx(1.96)


def test_paired_difference_hand_computed():
    # seeds 0..2 paired (seed 3 only in the arm is left out): differences 0.1, 0.2, 0.3 → mean 0.2, sd 0.1,
    # half-width t(2)·0.1/√3 = 4.303·0.057735 = 0.24843
    arm = {0: 0.5, 1: 0.7, 2: 0.4, 3: 9.0}
    base = {0: 0.4, 1: 0.5, 2: 0.1}
    m, h, seeds, diffs = paired_difference(arm, base)
    assert seeds == [0, 1, 2] and diffs == pytest.approx([0.1, 0.2, 0.3])
    assert m == pytest.approx(0.2) and h == pytest.approx(4.303 * 0.1 / math.sqrt(3), rel=1e-6)  # t-table value of t_quantile(2)
    # pairing removes a shared per-seed offset that the unpaired CI would count as noise
    shared = {0: 0.0, 1: 1.0, 2: -1.0}
    a = {s: v + 0.05 for s, v in shared.items()}
    m, h, _, _ = paired_difference(a, shared)
    assert m == pytest.approx(0.05) and h == pytest.approx(0.0, abs=1e-12)
    assert final_mean_ci(list(a.values()))[1] > 1.0
    m, h, seeds, _ = paired_difference({0: 1.0}, {1: 1.0})
    assert seeds == [] and math.isnan(m)
