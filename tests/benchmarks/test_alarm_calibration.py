"""The alarm simulation of benchmarks/alarm_calibration.py: the alpha-spending rule keeps a healthy run's chance of
any false alarm under alpha where the fixed per-look z does not, and it still catches a real fall."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flowcredit.rewards.guards import HackingAlarm

BENCHMARK = "alarm_calibration"  # benchmarks/alarm_calibration.py, the `bench` fixture (conftest.py)


def test_a_frozen_policy_never_fires(bench):
    # churn 0: the gold images never change, every fitted change is 0
    rng = np.random.default_rng(0)
    assert all(bench.churn_run(rng, HackingAlarm(), 50, 8, churn=0.0) == 0 for _ in range(5))


def test_spending_holds_alpha_where_the_per_look_test_does_not(bench):
    # 14 gold points (12 looks, a bit more than a 60-minute run) on the default 216 gold images, 30% redrawn per
    # interval: each look of the per-look test fires ≈ 2.3% of the time, and over 12 overlapping looks far more
    kw = {"n": 216, "points": 14, "churn": 0.3}
    per_look, _ = bench.fire_rate(lambda: HackingAlarm(), 200, 0, **kw)
    spend, _ = bench.fire_rate(lambda: HackingAlarm(alpha=0.05), 200, 0, **kw)
    assert spend <= 0.05 < 0.12 <= per_look
    # a steep fall is caught by both, the per-look test no later than the spending rule
    caught_fixed, look_fixed = bench.fire_rate(lambda: HackingAlarm(), 20, 1, fall=0.08, **kw)
    caught_spend, look_spend = bench.fire_rate(lambda: HackingAlarm(alpha=0.05), 20, 1, fall=0.08, **kw)
    assert caught_fixed == 1.0 and caught_spend >= 0.9 and look_fixed <= look_spend


def test_measure_run_reads_churn_from_a_checkpoint(bench, tmp_path):
    # 3 gold points on 4 images: 1 of 8 consecutive pairs changed; scores 0/1 with mean 0.5 → a redraw changes a
    # score with probability 1/2, so churn = (1/8) / (1/2)
    recs = [{"iteration": i, "mean": 0.5, "std": 0.5, "scores": s, "prompts": 4}
            for i, s in enumerate([[1, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]])]
    recs[2]["scores"] = [1, 0, 0, 1]
    d = tmp_path / "checkpoints" / "iter000002"
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"state": {"harness": {"guard": {"gold": {"records": recs}}}}}))
    p0, churn, n, points = bench.measure_run(tmp_path)
    assert (n, points) == (4, 3) and p0 == pytest.approx(5 / 12)
    changed = 2 / 8  # image 1 at the first interval, image 3 at the second
    q = np.array([7, 5]) / 12  # zeros and ones over all 12 scores
    assert churn == pytest.approx(changed / (1 - (q * q).sum()))
    with pytest.raises(SystemExit, match="no checkpoints"):
        bench.measure_run(tmp_path / "missing")
