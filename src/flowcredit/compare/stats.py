"""Statistics for comparing methods over seeds: mean curves with 95% bands, time-to-target, ratios.

All functions are pure numpy and tested on synthetic curves (tests/compare/test_stats.py).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

# two-sided 97.5% Student-t quantiles for n − 1 degrees of freedom (n seeds); larger n → 1.96
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t_quantile(dof: int) -> float:
    """Two-sided 95% Student-t quantile for `dof` degrees of freedom."""
    if dof < 1:
        return float("nan")
    return _T975.get(dof, 1.96 if dof > 30 else 2.09)


def interpolate(x: Sequence[float], y: Sequence[float], grid: np.ndarray) -> np.ndarray:
    """y(x) linearly interpolated on `grid`; NaN outside the observed x range (no extrapolation)."""
    xa = np.asarray(x, dtype=float)
    ya = np.asarray(y, dtype=float)
    out = np.interp(grid, xa, ya)
    out[(grid < xa.min()) | (grid > xa.max())] = np.nan
    return out


def mean_band(curves: Sequence[tuple[Sequence[float], Sequence[float]]], grid: np.ndarray,
              all_seeds: bool = False) -> dict[str, np.ndarray]:
    """Mean and 95% confidence band (Student t over seeds) of several (x, y) curves on a common grid.

    Args:
        curves: S (x, y) pairs, each x increasing; lengths may differ.
        grid: (G,) points to evaluate on.
        all_seeds: mean and band only where every seed covers the point (NaN elsewhere). Used for wall-clock
            axes, where seeds end at different times: there the seed set changes from point to point, so the mean
            jumps and the t quantile of fewer seeds inflates the band.

    Returns:
        {"grid", "mean", "lo", "hi", "n"}: (G,) arrays; n = seeds covering each grid point. Where only one
        seed covers a point the band collapses to the mean (no spread estimate).
    """
    ys = np.stack([interpolate(x, y, grid) for x, y in curves])  # (S, len(grid))
    n = np.sum(~np.isnan(ys), axis=0)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns and single-seed columns are handled below
        mean = np.nanmean(np.where(n[None] > 0, ys, 0.0), axis=0) if ys.size else np.array([])
        mean[n == 0] = np.nan
        sd = np.nanstd(ys, axis=0, ddof=1) if ys.shape[0] > 1 else np.zeros(len(grid))
        sd = np.where(n > 1, sd, 0.0)
        half = np.array([t_quantile(int(k) - 1) if k > 1 else 0.0 for k in n]) * sd / np.sqrt(np.maximum(n, 1))
    lo, hi = mean - half, mean + half
    if all_seeds:
        partial = n < len(curves)
        mean, lo, hi = (np.where(partial, np.nan, a) for a in (mean, lo, hi))
    return {"grid": grid, "mean": mean, "lo": lo, "hi": hi, "n": n}


def time_to_target(x: Sequence[float], y: Sequence[float], target: float) -> float | None:
    """First x at which the curve reaches `target` (linear interpolation between the two bracketing points).

    Returns None when the curve never reaches the target ("never reached").
    """
    xa = np.asarray(x, dtype=float)
    ya = np.asarray(y, dtype=float)
    hit = np.nonzero(ya >= target)[0]
    if hit.size == 0:
        return None
    k = int(hit[0])
    if k == 0:
        return float(xa[0])
    x0, x1, y0, y1 = xa[k - 1], xa[k], ya[k - 1], ya[k]
    return float(x0 + (target - y0) * (x1 - x0) / (y1 - y0)) if y1 != y0 else float(x1)


def summarize_times(times: Sequence[float | None]) -> dict[str, float | int | None]:
    """Mean over seeds that reached the target, how many reached it, and how many seeds there were."""
    reached = [t for t in times if t is not None]
    return {
        "mean": float(np.mean(reached)) if reached else None,
        "reached": len(reached),
        "seeds": len(times),
    }


def ratio(method: float | None, baseline: float | None) -> float | None:
    """method / baseline time-to-target; None if either never reached the target (or the baseline is 0)."""
    if method is None or baseline is None or baseline == 0:
        return None
    return method / baseline


def final_mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and 95% half-width (Student t) of per-seed final values."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return float("nan"), float("nan")
    if v.size == 1:
        return float(v[0]), 0.0
    return float(v.mean()), float(t_quantile(v.size - 1) * v.std(ddof=1) / math.sqrt(v.size))


def paired_difference(
    arm: dict[int, float], baseline: dict[int, float]
) -> tuple[float, float, list[int], list[float]]:
    """Mean and 95% half-width (Student t) of arm − baseline over the seeds both have.

    Runs of the same seed share the prompt order, the initial noise and the evaluation noise, so the per-seed
    difference removes what the arms have in common; its spread is the arms' own seed-to-seed disagreement.

    Args:
        arm, baseline: {seed: final value}; seeds missing from either side are left out.

    Returns:
        (mean, half-width, the paired seeds in order, the per-seed differences); NaN mean if no seed pairs.
    """
    seeds = sorted(set(arm) & set(baseline))
    diffs = [float(arm[s] - baseline[s]) for s in seeds]
    m, h = final_mean_ci(diffs)
    return m, h, seeds, diffs
