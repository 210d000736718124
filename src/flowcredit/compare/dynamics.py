"""The study report's training-dynamics table: how each arm moved while it trained (advantages it was given, KL to
the reference, flow-matching error on its own samples, diversity, train reward), from the runs' metrics.jsonl."""

from __future__ import annotations

from typing import Any

import numpy as np

# (metric key, column label, how it is summarised): "mean" over all iterations ("signed": with its sign shown),
# "last" over the last `window` iterations, "drift" first `window` → last `window`. A column appears only where some
# run logged the key.
DYNAMICS = (
    ("credit/adv_mean", "advantage mean", "signed"),
    ("credit/adv_std", "advantage std", "mean"),
    ("kl", "KL to the reference, last {w}", "last"),
    ("fm_mse", "flow-matching error on its own samples, first → last {w}", "drift"),
    ("diversity", "within-group diversity, first → last {w}", "drift"),
    ("reward_mean", "train reward, first → last {w}", "drift"),
)


def dynamics_table(runs: dict[str, list[dict[str, Any]]], window: int = 20) -> list[str]:
    """Markdown lines: how each arm's training moved, mean over its seeds (the "why" behind the final table).

    Args:
        runs: arm name → its runs, each with ``"metrics"``: the run's metrics.jsonl rows (one per iteration).
        window: iterations averaged at the start and at the end of a run.
    """
    cols = [c for c in DYNAMICS if any(c[0] in x for rs in runs.values() for r in rs for x in r["metrics"])]
    if not cols:
        return []

    def cell(rs: list[dict[str, Any]], key: str, how: str) -> str:
        per_run = []
        for r in rs:
            v = np.array([x[key] for x in r["metrics"] if isinstance(x.get(key), (int, float))], dtype=float)
            if v.size:
                per_run.append((v.mean(), v[-window:].mean(), v[:window].mean()))
        if not per_run:
            return "–"
        mean, last, first = np.mean(per_run, axis=0)
        if how in ("mean", "signed"):
            return f"{mean:+.3f}" if how == "signed" else f"{mean:.3f}"
        if how == "last":
            return f"{last:.4f}"
        return f"{first:.3f} → {last:.3f}"

    lines = [
        "## Training dynamics (mean over seeds)",
        "",
        "How the arms moved while they trained, from the runs' metrics.jsonl: the advantages they were given, how far "
        f"the policy went from the reference, how well it still fits its own samples, and how varied and how good its "
        f"training samples were (first and last {window} iterations).",
        "",
        "| arm | " + " | ".join(label.format(w=window) for _, label, _ in cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for name, rs in runs.items():
        lines.append(f"| {name} | " + " | ".join(cell(rs, k, how) for k, _, how in cols) + " |")
    return lines + [""]
