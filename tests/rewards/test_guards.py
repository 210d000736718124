"""Hacking guards: gold monitor on fixed prompts, within-group diversity, trend and the alarm."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowcredit.rewards.guards import GoldMonitor, HackingAlarm, group_diversity, pairwise_distance, trend
from flowcredit.rewards.registry import build_reward


def test_gold_monitor_on_fixed_shapes_prompts():
    from flowcredit.shapes.render import render_record

    gold = GoldMonitor.from_prompts(build_reward("shapes"), "shapes:test_unique", every=5, limit=4)
    assert [gold.due(i) for i in range(0, 11)] == [i % 5 == 0 for i in range(11)]

    def perfect(prompts, meta):
        return torch.from_numpy(np.stack([render_record(m, seed=0, index=i) for i, m in enumerate(meta)])).permute(0, 3, 1, 2).float() / 255

    rec = gold.run(0, perfect)
    assert rec.mean == 1.0 and len(rec.scores) == 4 and rec.components["strict"] == 1.0
    blank = gold.evaluate(5, torch.ones(8, 3, 32, 32))  # 2 samples per prompt
    assert blank.mean < 0.5 and len(blank.scores) == 8
    assert gold.series() == ([0, 5], [1.0, blank.mean])
    assert gold.stats()["gold/mean"] == blank.mean
    other = GoldMonitor(build_reward("shapes"), gold.prompts, gold.metadata)
    other.load_state_dict(gold.state_dict())
    assert other.series() == gold.series()
    with pytest.raises(ValueError, match="multiple"):
        gold.evaluate(10, torch.ones(3, 3, 32, 32))


def test_diversity():
    same = torch.rand(1, 3, 8, 8).repeat(4, 1, 1, 1)
    assert pairwise_distance(same) == 0
    bw = torch.stack([torch.zeros(3, 8, 8), torch.ones(3, 8, 8)])
    assert pairwise_distance(bw) == pytest.approx(1.0)  # RMS per element
    x = torch.cat([same, bw, torch.rand(3, 3, 8, 8)])
    gids = [7] * 4 + [3] * 2 + [9] * 3
    d = group_diversity(x, gids)
    assert d.shape == (3,) and d[0] == pytest.approx(1.0) and d[1] == 0 and 0 < d[2] < 1  # sorted ids 3, 7, 9
    f = group_diversity(x, gids, features=lambda im: im.mean(dim=(2, 3)))
    assert f.shape == (3,) and f[1] == 0
    # a hand computation for 3 points
    pts = torch.tensor([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]])
    assert pairwise_distance(pts, normalize=False) == pytest.approx((5 + 10 + 5) / 3)


def test_trend_and_alarm():
    assert trend([1, 2, 3]) == pytest.approx(1.0)
    assert trend([5, 5]) == 0 and trend([1]) == 0
    assert trend([0, 2, 4], [0, 10, 20]) == pytest.approx(0.2)
    alarm = HackingAlarm(window=4, min_points=3, train_rise=0.05, gold_drop=0.05)
    for it in range(0, 31):
        alarm.update_train(it, 0.3 + 0.01 * it)  # training reward keeps rising
    healthy = HackingAlarm(window=4, min_points=3, train_rise=0.05, gold_drop=0.05)
    healthy.train = list(alarm.train)
    for it, (g_bad, g_ok) in zip(range(0, 31, 10), [(0.8, 0.5), (0.7, 0.55), (0.6, 0.6), (0.5, 0.65)]):
        alarm.update_gold(it, g_bad)
        healthy.update_gold(it, g_ok)
        if it == 10:
            assert not alarm.check().fired and "waiting" in alarm.check().message
    s = alarm.check()
    assert s.fired and s.reasons == ["gold_down"] and s.gold_change == pytest.approx(-0.3) and s.train_change == pytest.approx(0.3)
    assert "possible reward hacking" in s.message
    assert not healthy.check().fired
    d = HackingAlarm(window=4, min_points=3, diversity_drop=0.1)
    d.load_state_dict(healthy.state_dict())
    for it in range(0, 31, 10):
        d.update_diversity(it, 0.5 - 0.01 * it)
    assert d.check().reasons == ["diversity_down"]
