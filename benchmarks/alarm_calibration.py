"""How often does the hacking alarm fire on a healthy run, and how soon does it catch a real fall? A simulation of the
gold guard (`rewards.guards.HackingAlarm` as it is, paired standard error included) on synthetic gold histories.

    python benchmarks/alarm_calibration.py                      # 216 gold images, 12 gold points, 1000 runs per row
    python benchmarks/alarm_calibration.py --run runs/stab60_s4  # churn and marginal measured on a real run

The model of a gold history: n gold images with a 0/1 score each (the fixed prompts and noise of the guard); the
policy moves, so between two gold points each image is redrawn with probability `churn` from Bernoulli(p_t). A
healthy run has p_t = p0 throughout (a plateau whose images still flip: what a long run at a small learning rate does);
a run that really loses gold has p_t = p0 − fall · t. The training reward always rises, the worst case for false
alarms (the alarm needs it rising). Each row prints the share of runs whose alarm fired at least once, and the median
look of the first alarm, for the fixed per-look z (`alarm_alpha=0`, `noise_z`) and for the alpha-spending rule
(`alarm_alpha`, `spending_z`). The false-alarm row (fall 0) of the spending rule is bounded by alpha whatever the
churn (union bound over the looks); the per-look rule's grows with the number of looks.

--run DIR reads the gold records of a run's last checkpoint (per-image scores) and measures p0 (mean gold score) and
the churn: the share of images whose score changed between consecutive gold points, divided by the chance that a
redraw changes a score, 1 − Σ_v q_v² over the marginal q of the scores (2 p0 (1 − p0) for 0/1 scores).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from flowcredit.rewards.guards import HackingAlarm


def churn_run(
    rng: np.random.Generator,
    alarm: HackingAlarm,
    n: int,
    points: int,
    churn: float,
    fall: float = 0.0,
    p0: float = 0.5,
    every: int = 75,
) -> int:
    """One simulated gold history fed to `alarm` (module docstring); returns the look of its first alarm, 0 if
    it stayed quiet. n images, `points` gold points `every` iterations apart, p_t = p0 − fall · t."""
    p, s = p0, (rng.random(n) < p0).astype(float)
    for k in range(points):
        if k:
            p = max(p - fall, 0.0)
            redraw = rng.random(n) < churn
            s = np.where(redraw, (rng.random(n) < p).astype(float), s)
        alarm.update_train(every * k, 0.01 * k)
        alarm.update_gold(every * k, float(s.mean()), se=float(s.std() / n**0.5), scores=s.tolist())
        st = alarm.check()
        if st.fired:
            return st.look
    return 0


def fire_rate(
    make_alarm, runs: int, seed: int, **kw
) -> tuple[float, float | None]:
    """(share of `runs` simulated runs that fired, median look of the first alarm among them or None)."""
    rng = np.random.default_rng(seed)
    looks = [churn_run(rng, make_alarm(), **kw) for _ in range(runs)]
    fired = [k for k in looks if k > 0]
    return len(fired) / runs, (statistics.median(fired) if fired else None)


def measure_run(run: Path) -> tuple[float, float, int, int]:
    """(p0, churn, images, gold points) of a finished run, from the gold records of its last checkpoint."""
    ckpts = sorted((run / "checkpoints").glob("iter*/state.json"))
    if not ckpts:
        raise SystemExit(f"{run}: no checkpoints/iter*/state.json with gold records; run with run.checkpoint_every")
    state = json.loads(ckpts[-1].read_text())["state"]
    recs = state.get("harness", {}).get("guard", {}).get("gold", {}).get("records", [])
    rows = [r["scores"] for r in recs if r.get("scores")]
    if len(rows) < 2:
        raise SystemExit(f"{ckpts[-1]}: fewer than 2 gold records with per-image scores")
    y = np.asarray(rows, dtype=float)  # (points, images)
    changed = float((np.abs(np.diff(y, axis=0)) > 1e-9).mean())
    _, counts = np.unique(np.round(y, 6), return_counts=True)
    q = counts / counts.sum()
    p_change = 1.0 - float((q * q).sum())
    return float(y.mean()), changed / p_change, y.shape[1], y.shape[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, help="measure p0 and churn on this run folder (its last checkpoint)")
    ap.add_argument("--images", type=int, default=216, help="gold images (run.gold_limit)")
    ap.add_argument("--points", type=int, default=12, help="gold points per run (60 min ≈ 900 iterations / 75)")
    ap.add_argument("--churn", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    ap.add_argument("--p0", type=float, default=0.5)
    ap.add_argument("--falls", type=float, nargs="+", default=[0.0, 0.01, 0.02, 0.03, 0.05],
                    help="fall of p per gold point (0 = healthy)")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--alpha", type=float, default=0.05, help="run.alarm_alpha of the spending rule")
    ap.add_argument("--noise-z", type=float, default=2.0, help="run.alarm_noise_z of the per-look rule")
    ap.add_argument("--window", type=int, default=5, help="run.alarm_window")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    churns, p0, n, points = a.churn, a.p0, a.images, a.points
    if a.run is not None:
        p0, c, n, points = measure_run(a.run)
        churns = [min(c, 1.0)]
        print(f"{a.run}: {points} gold points on {n} images, mean score p0 {p0:.3f}, churn {c:.3f} per gold interval")
    print(f"{a.runs} simulated runs per row, {n} images, {points} gold points ({points - 2} looks), window "
          f"{a.window}; per-look z {a.noise_z:g} vs run-level alpha {a.alpha:g}")
    print("| churn | fall per point | per-look z: runs fired | median first look | alpha spending: runs fired | "
          "median first look |")
    print("|---|---|---|---|---|---|")
    for churn in churns:
        for fall in a.falls:
            kw = {"n": n, "points": points, "churn": churn, "fall": fall, "p0": p0}
            fixed = fire_rate(lambda: HackingAlarm(window=a.window, noise_z=a.noise_z), a.runs, a.seed, **kw)
            spend = fire_rate(lambda: HackingAlarm(window=a.window, alpha=a.alpha), a.runs, a.seed, **kw)
            print(f"| {churn:.3g} | {fall:g} | {fixed[0]:.3f} | {fixed[1] if fixed[1] is not None else '—'} | "
                  f"{spend[0]:.3f} | {spend[1] if spend[1] is not None else '—'} |", flush=True)


if __name__ == "__main__":
    main()
