"""Hacking guards: gold monitor on fixed prompts, within-group diversity, trend and the alarm."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowcredit.rewards.guards import (
    AlarmState,
    GoldMonitor,
    HackingAlarm,
    group_diversity,
    paired_change_se,
    pairwise_distance,
    spending_z,
    trend,
    trend_se,
)
from flowcredit.rewards.registry import build_reward


def test_gold_monitor_on_fixed_shapes_prompts():
    from flowcredit.shapes.render import render_record

    gold = GoldMonitor.from_prompts(build_reward("shapes"), "shapes:test_unique", every=5, limit=4)
    assert [gold.due(i) for i in range(0, 11)] == [i % 5 == 0 for i in range(11)]

    def perfect(prompts, meta):
        return (
            torch.from_numpy(np.stack([render_record(m, seed=0, index=i) for i, m in enumerate(meta)]))
            .permute(0, 3, 1, 2)
            .float()
            / 255
        )

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
    assert (
        s.fired
        and s.reasons == ["gold_down"]
        and s.gold_change == pytest.approx(-0.3)
        and s.train_change == pytest.approx(0.3)
    )
    assert "possible reward hacking" in s.message
    assert not healthy.check().fired
    d = HackingAlarm(window=4, min_points=3, diversity_drop=0.1)
    d.load_state_dict(healthy.state_dict())
    for it in range(0, 31, 10):
        d.update_diversity(it, 0.5 - 0.01 * it)
    assert d.check().reasons == ["diversity_down"]


# ----------------------------------------------------------------------------------------------- noise-aware gold test
def test_gold_record_se_is_std_over_sqrt_prompts():
    gold = GoldMonitor.from_prompts(build_reward("shapes"), "shapes:test_unique", limit=4)
    rec = gold.evaluate(0, torch.rand(8, 3, 32, 32))  # 2 samples per prompt: still 4 independent prompts
    assert rec.prompts == 4 and rec.se == pytest.approx(rec.std / 2.0)
    assert gold.stats()["gold/se"] == pytest.approx(rec.se)
    old = dict(gold.state_dict()["records"][0])
    del old["prompts"]  # a record saved before the prompt count was kept: counts its scores
    other = GoldMonitor(build_reward("shapes"), ["x"], [{}])
    other.load_state_dict({"records": [old]})
    assert other.records[0].se == pytest.approx(rec.std / 8**0.5)


def test_trend_se_matches_the_least_squares_slope_variance():
    xs, ses = [0.0, 10.0, 20.0, 40.0], [0.01, 0.02, 0.03, 0.015]
    # hand computation: mean x = 17.5, xc = -17.5, -7.5, 2.5, 22.5, Σ xc² = 875
    num = 17.5**2 * 0.01**2 + 7.5**2 * 0.02**2 + 2.5**2 * 0.03**2 + 22.5**2 * 0.015**2
    assert trend_se(ses, xs) == pytest.approx(num**0.5 / 875.0)
    # direct: slope = row 1 of (XᵀX)⁻¹Xᵀ y, so Var(slope) = [A diag(s²) Aᵀ]₁₁
    x = np.array([np.ones(4), xs]).T
    a = np.linalg.inv(x.T @ x) @ x.T
    cov = a @ np.diag(np.square(ses)) @ a.T
    assert trend_se(ses, xs) == pytest.approx(np.sqrt(cov[1, 1]), rel=1e-10)
    # and by simulation of the fitted slope (torch): its spread matches
    g = torch.Generator().manual_seed(0)
    y = torch.randn(20000, 4, generator=g, dtype=torch.float64) * torch.tensor(ses, dtype=torch.float64)
    slopes = torch.tensor([trend(row.tolist(), xs) for row in y[:4000]])
    assert float(slopes.std()) == pytest.approx(trend_se(ses, xs), rel=0.05)
    # None counts as 0 noise; equal standard errors give the textbook s / sqrt(Σ xc²); fewer than 2 points: 0
    assert trend_se([None, 0.02, None], [0, 1, 2]) == 0.0
    assert trend_se([0.1, 0.1, 0.1]) == pytest.approx(0.1 / 2**0.5)
    assert trend_se([0.5]) == 0.0


def _alarm_with(drop: float, se: float | None, noise_z: float = 2.0, **kw) -> HackingAlarm:
    """Training reward rising; gold points at 0, 10, 20, 30 falling linearly by `drop` over the window."""
    alarm = HackingAlarm(window=4, min_points=3, noise_z=noise_z, **kw)
    for it in range(0, 31):
        alarm.update_train(it, 0.3 + 0.01 * it)
    for it in range(0, 31, 10):
        alarm.update_gold(it, 0.6 - drop * it / 30, se=se)
    return alarm


def test_alarm_noise_z_zero_is_the_old_test():
    old = _alarm_with(0.001, se=0.03, noise_z=0.0).check()  # a tiny fall, far inside the noise: fires as before
    assert old.fired and old.reasons == ["gold_down"] and old.gold_change == pytest.approx(-0.001)
    assert old.gold_threshold == 0.0 and old.gold_se > 0
    assert _alarm_with(0.001, se=None).check().fired  # no standard errors known: 0 noise, the old test too
    assert _alarm_with(0.001, se=None, gold_drop=0.01).check().fired is False
    assert AlarmState(False, 0.0, 0.0, None, [], "").gold_threshold == 0.0  # the new fields have defaults
    with pytest.raises(ValueError, match="noise_z"):
        HackingAlarm(noise_z=-1.0)


def test_alarm_gold_must_fall_by_more_than_z_standard_errors():
    se = 0.03 / 32**0.5 * 4  # about the 32-prompt gold guard's noise
    # x = 0, 10, 20, 30: Σ xc² = 500, SE(change) = se · sqrt(500) / 500 · 30
    se_change = se * 500**0.5 / 500 * 30
    small, large = 1.5 * se_change, 2.5 * se_change
    quiet = _alarm_with(small, se).check()
    assert not quiet.fired and quiet.gold_change == pytest.approx(-small)
    assert quiet.gold_se == pytest.approx(se_change) and quiet.gold_threshold == pytest.approx(2 * se_change)
    assert f"fall threshold {2 * se_change:.4f}" in quiet.message
    loud = _alarm_with(large, se).check()
    assert loud.fired and loud.reasons == ["gold_down"] and loud.gold_threshold == pytest.approx(2 * se_change)
    # the absolute threshold wins when it is larger; noise_z=1 lets the smaller fall through
    assert not _alarm_with(large, se, gold_drop=3 * se_change).check().fired
    assert _alarm_with(small, se, noise_z=1.0).check().fired
    # the standard errors survive a checkpoint; an old checkpoint (no gold_se) counts as 0 noise
    restored = HackingAlarm(window=4, min_points=3)
    restored.load_state_dict(_alarm_with(small, se).state_dict())
    assert restored.check().gold_se == pytest.approx(se_change) and not restored.check().fired
    legacy = {k: v for k, v in _alarm_with(small, se).state_dict().items() if k != "gold_se"}
    restored.load_state_dict(legacy)
    assert restored.check().gold_se == 0.0 and restored.check().fired
    restored.update_gold(40, 0.55, se=se)  # new points after an old checkpoint keep their standard error
    assert restored.gold_se == [None, None, None, None, se]


def test_hacking_guard_passes_the_standard_error_to_the_alarm():
    from flowcredit.config.schema import RunCfg
    from flowcredit.shapes.render import render_record
    from flowcredit.trainer.harness import HackingGuard

    cfg = RunCfg(
        gold_reward="shapes",
        gold_every=1,
        gold_limit=4,
        alarm_window=3,
        alarm_gold_drop=0.0,
        alarm_noise_z=2.0,
        alarm_alpha=0.0,  # the fixed per-look z
    )
    guard = HackingGuard.from_config(cfg, build_reward)
    assert guard is not None and guard.alarm.noise_z == 2.0 and guard.alarm.gold_drop == 0.0
    assert guard.alarm.alpha is None

    def sample(correct):  # the first `correct` prompts drawn right, the others blank: scores vary, so std > 0
        def fn(prompts, meta):
            ok = [render_record(m, seed=0, index=i) for i, m in enumerate(meta)]
            ims = torch.from_numpy(np.stack(ok)).permute(0, 3, 1, 2).float() / 255
            ims[correct:] = 1.0
            return ims

        return fn

    def run(g: HackingGuard) -> list:  # gold 0.75, 0.5, 0.5 on 4 prompts while the training reward rises
        return [
            g.step(it, {"reward_mean": 0.1 * it, "diversity": 0.2}, sample(c)) for it, c in [(1, 3), (2, 2), (3, 2)]
        ]

    lines = run(guard)
    for line, rec in zip(lines, guard.gold.records):
        assert line is not None and line["gold_se"] == pytest.approx(rec.std / 2.0)  # 4 prompts
    assert [line["gold_se"] for line in lines] == pytest.approx([0.433013 / 2, 0.25, 0.25], abs=1e-5)
    assert guard.alarm.gold_se == pytest.approx([line["gold_se"] for line in lines])
    state = guard.alarm.check()
    assert state.gold_change == pytest.approx(-0.25) and state.gold_se > 0.125  # one flipped image out of 4
    assert lines[-1]["gold_threshold"] == pytest.approx(2.0 * state.gold_se) and not lines[-1]["alarm"]
    assert lines[-1]["gold_z"] == 2.0 and lines[-1]["look"] == 1 and lines[0]["look"] == 0
    # the default spends run.alarm_alpha = 0.05 over the looks: the first look's z is 1.96
    spend = HackingGuard.from_config(RunCfg(gold_reward="shapes", gold_every=1, gold_limit=4, alarm_window=3),
                                     build_reward)
    assert spend is not None and spend.alarm.alpha == 0.05
    last = run(spend)[-1]
    assert last["look"] == 1 and last["gold_z"] == pytest.approx(1.959964, abs=1e-6)
    assert last["gold_threshold"] == pytest.approx(1.959964 * state.gold_se, rel=1e-6)
    # run.alarm_noise_z=0 and alarm_alpha=0 (and no absolute drop): the same fall fires, as before the noise test
    old = HackingGuard.from_config(
        RunCfg(gold_reward="shapes", gold_every=1, gold_limit=4, alarm_window=3, alarm_noise_z=0.0, alarm_alpha=0.0),
        build_reward,
    )
    assert old is not None
    last = run(old)[-1]
    assert last["alarm"] and last["gold_threshold"] == 0.0 and last["gold_se"] == pytest.approx(0.25)
    off = HackingGuard.from_config(RunCfg(gold_reward="shapes", alarm_gold_drop=0.05, alarm_noise_z=0.0), build_reward)
    assert off is not None and off.alarm.noise_z == 0.0 and off.alarm.gold_drop == 0.05


def test_paired_change_se_by_hand_and_against_the_independent_one():
    # 3 points (x = 0, 1, 2: Σ xc² = 2, span 2) on 4 images: per-image changes 0, 0, −1, 0 → std 0.5, SE 0.25
    scores = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    assert paired_change_se(scores, [0, 1, 2]) == pytest.approx(0.5 / 2.0)
    # the per-image changes' mean is the fitted change of the means (least squares is linear)
    ch = [trend([r[i] for r in scores], [0, 1, 2]) * 2 for i in range(4)]
    assert np.mean(ch) == pytest.approx(trend([np.mean(r) for r in scores], [0, 1, 2]) * 2)
    # missing or ragged score lists: no paired SE (the alarm then uses trend_se)
    assert paired_change_se([scores[0], None, scores[2]], [0, 1, 2]) is None
    assert paired_change_se([scores[0], scores[1][:3]], [0, 1]) is None
    # fixed prompts and noise: images differ a lot from each other but little over time; every image falls by 0.02,
    # so the fall is certain, which the paired SE sees (0) and the independent SE (std/sqrt(n) per point) does not
    rng = np.random.default_rng(0)
    base = rng.uniform(0.0, 1.0, size=64)
    pts = [(base - 0.01 * k).tolist() for k in range(3)]
    xs = [0, 50, 100]
    assert paired_change_se(pts, xs) == pytest.approx(0.0, abs=1e-12)
    independent = trend_se([float(np.std(p) / 8) for p in pts], xs) * 100
    assert independent > 0.05
    alarm = HackingAlarm(window=3, min_points=3)
    for it, p in zip(xs, pts):
        alarm.update_train(it, it / 100)
        alarm.update_gold(it, float(np.mean(p)), se=float(np.std(p) / 8), scores=p)
    st = alarm.check()
    assert st.fired and st.gold_change == pytest.approx(-0.02) and "paired SE" in st.message
    blind = HackingAlarm(window=3, min_points=3)  # the same points without scores: the fall hides in the spread
    for it, p in zip(xs, pts):
        blind.update_train(it, it / 100)
        blind.update_gold(it, float(np.mean(p)), se=float(np.std(p) / 8))
    assert not blind.check().fired
    # only the last `window` score lists are kept (checkpoint size), and they survive a checkpoint
    alarm.update_gold(150, 0.5, se=0.01, scores=pts[0])
    assert alarm.gold_scores[0] is None and alarm.gold_scores[-1] == pts[0]
    again = HackingAlarm(window=3, min_points=3)
    again.load_state_dict(alarm.state_dict())
    assert again.gold_scores == alarm.gold_scores and again.check().gold_se == pytest.approx(alarm.check().gold_se)


# --------------------------------------------------------------------------------------------- run-level error control
def test_spending_z_spends_alpha_over_the_looks():
    from statistics import NormalDist

    phi = NormalDist().cdf
    assert spending_z(1, 0.05) == pytest.approx(1.959964, abs=1e-6)  # alpha/2 at the first look
    assert spending_z(10, 0.05) == pytest.approx(NormalDist().inv_cdf(1 - 0.05 / 110))
    z = [spending_z(k, 0.05) for k in range(1, 201)]
    assert all(a < b for a, b in zip(z, z[1:]))  # the threshold only rises
    spent = sum(1 - phi(v) for v in z)  # Σ_k alpha/(k(k+1)) over 200 looks = alpha (1 − 1/201)
    assert spent == pytest.approx(0.05 * (1 - 1 / 201), rel=1e-9)
    for bad in [(0, 0.05), (1, 0.0), (1, 1.0)]:
        with pytest.raises(ValueError, match="spending_z"):
            spending_z(*bad)
    with pytest.raises(ValueError, match="alpha"):
        HackingAlarm(alpha=1.5)


def _window_scores(n: int, falls: int, points: int) -> list[list[float]]:
    """`points` score lists over n images: half right at first, `falls` more images wrong at every point."""
    out, s = [], [1.0] * (n // 2) + [0.0] * (n - n // 2)
    for _ in range(points):
        out.append(list(s))
        s = [0.0 if i < falls * (len(out)) else v for i, v in enumerate(s)]
    return out


def test_alarm_alpha_counts_looks_and_raises_its_threshold():
    n = 200
    rows = _window_scores(n, falls=2, points=12)  # 2 of 200 images go wrong per point: a steady, small fall

    def feed(alarm: HackingAlarm, upto: int) -> list[AlarmState]:
        states = []
        for k in range(upto):
            alarm.update_train(10 * k, 0.01 * k)
            alarm.update_gold(10 * k, float(np.mean(rows[k])), se=0.035, scores=rows[k])
            states.append(alarm.check())
        return states

    fixed = feed(HackingAlarm(window=3, min_points=3), 12)
    spend = feed(HackingAlarm(window=3, min_points=3, alpha=0.05), 12)
    assert [s.look for s in spend] == [0, 0] + list(range(1, 11))
    assert [s.z for s in fixed[2:]] == [2.0] * 10
    assert [s.z for s in spend[2:]] == pytest.approx([spending_z(k, 0.05) for k in range(1, 11)])
    # the same window (the same fall and SE at every look) meets a rising threshold
    for f, a in zip(fixed[2:], spend[2:]):
        assert a.gold_change == pytest.approx(f.gold_change) and a.gold_se == pytest.approx(f.gold_se)
        assert a.gold_threshold == pytest.approx(a.z * a.gold_se)
    assert "look 1 of a run-level alpha 0.05" in spend[2].message
    # the per-look test is reported beside the run-level alarm as a warning: it fires where the fixed-z alarm fires
    assert [s.warning for s in spend] == [s.fired for s in fixed]
    assert [s.warning for s in fixed] == [s.fired for s in fixed]
    late = [a for a, f in zip(spend[2:], fixed[2:]) if f.fired and not a.fired]
    assert late and all("warning: gold fell by more than 2 SE" in a.message for a in late)
    assert not any("warning" in f.message for f in fixed)  # without alpha the warning is the alarm itself
    # a resumed alarm counts its looks on from the gold history, and several checks at one point are one look
    again = HackingAlarm(window=3, min_points=3, alpha=0.05)
    half = HackingAlarm(window=3, min_points=3, alpha=0.05)
    feed(half, 6)
    again.load_state_dict(half.state_dict())
    assert again.check().look == 4 and again.check().look == 4
    assert again.check().z == pytest.approx(spend[5].z)

