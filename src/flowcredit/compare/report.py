"""The study report: curves vs iteration and vs wall-clock seconds (mean and 95% band over seeds), time-to-target
with ratios to the baseline, final held-out numbers, per-tag accuracy, the Stepwise paper's Fig. 1 / Fig. 2
analogues, a cost table and the training-dynamics table (dynamics.py). Everything lands in one folder: `report.md`
+ PNGs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .dynamics import dynamics_table
from .figures import reward_trajectory_figure
from .stats import final_mean_ci, mean_band, paired_difference, ratio, summarize_times, time_to_target
from .study import Study, git_commit, resolved_config, reused_from, run_commits, run_dir


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_run(d: Path) -> dict[str, Any]:
    """Curves of one finished run: train reward and eval values vs iteration and cumulative seconds."""
    m = read_jsonl(d / "metrics.jsonl")
    ev = read_jsonl(d / "eval_curve.jsonl")
    it = np.array([r["iteration"] for r in m], dtype=float)
    sec = np.cumsum([r.get("seconds_total", 0.0) + 0.0 for r in m])
    sec_at = dict(zip(it.tolist(), sec.tolist()))
    final = json.loads((d / "eval.json").read_text()) if (d / "eval.json").exists() else None
    out = {
        "iteration": it,
        "seconds": sec,
        "reward": np.array([r["reward_mean"] for r in m]),
        "strict": np.array([r.get("strict_mean", np.nan) for r in m]),
        "final": final,
        "metrics": m,
    }
    # periodic evaluations on the same prompt subset, starting with the initial model at iteration 0
    out["eval_iteration"] = np.array([e["iteration"] for e in ev], dtype=float)
    out["eval_reward"] = np.array([e["eval_reward"] for e in ev], dtype=float)
    out["eval_strict"] = np.array([np.nan if e["eval_strict"] is None else e["eval_strict"] for e in ev], dtype=float)
    out["eval_seconds"] = np.array(
        [0.0 if e["iteration"] == 0 else sec_at.get(float(e["iteration"]), np.nan) for e in ev]
    )
    return out


def _running_mean(y: np.ndarray, k: int) -> np.ndarray:
    """Mean of the last min(k, i + 1) values at each position i (same length as y)."""
    c = np.cumsum(np.insert(np.asarray(y, dtype=float), 0, 0.0))
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(i - k, 0)
    return (c[i] - c[lo]) / (i - lo)


def _band_plot(ax, study_runs, key_x, key_y, label_y, grid_max):
    for name, runs in study_runs.items():
        curves = [(r[key_x], r[key_y]) for r in runs if len(r[key_x]) > 1 and np.all(np.isfinite(r[key_y]))]
        if not curves:
            continue
        grid = np.linspace(0, grid_max, 200)
        b = mean_band(curves, grid, all_seeds="iteration" not in key_x)  # wall clock: up to the shortest seed
        ax.plot(grid, b["mean"], label=f"{name} (n={len(curves)})")
        ax.fill_between(grid, b["lo"], b["hi"], alpha=0.2)
    ax.set_xlabel("iteration" if "iteration" in key_x else "wall-clock seconds (training)")
    ax.set_ylabel(label_y)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a study without periodic evaluations has no eval curves
        ax.legend(fontsize=7)


def _run_commits_line(study: Study, out: Path) -> str:
    commits: dict[str, int] = {}
    missing = 0
    for r in study.runs:
        for s in study.seeds:
            d = run_dir(out, r, s)
            if not (d / "metrics.jsonl").exists():
                continue
            cs = run_commits(d)
            missing += not cs
            for c in dict.fromkeys(cs):
                commits[c] = commits.get(c, 0) + 1
    parts = [f"`{c}` ({n} run{'s' * (n != 1)})" for c, n in commits.items()]
    if missing:
        parts.append(f"not recorded for {missing} run{'s' * (missing != 1)}")
    return "; ".join(parts) or "no runs"


def _reused_line(study: Study, out: Path) -> list[str]:
    items = []
    for r in study.runs:
        for s in study.seeds:
            src = reused_from(run_dir(out, r, s))
            if src:
                items.append(f"{r.name}/seed{s} ← `{src}`")
    if not items:
        return []
    return ["- reused, not retrained (identical resolved config; `--reuse`): " + "; ".join(items)]


def _budgeted(study: Study, out: Path) -> bool:
    """Whether the study's runs stop on a time budget (resolved run.budget_minutes > 0, preset or override), so
    `iterations` is only a cap."""
    return any(resolved_config(study, r, study.seeds[0], out, 1).run.budget_minutes > 0 for r in study.runs)


def verdict(mean: float, half: float, n: int, arm: str, baseline: str) -> str:
    """'arm better' / 'baseline better' only where the 95% CI of the paired difference excludes 0 (n ≥ 2)."""
    if n < 2 or not np.isfinite(mean) or not np.isfinite(half):
        return "too few seeds"
    if mean - half > 0:
        return f"{arm} better"
    if mean + half < 0:
        return f"{baseline} better"
    return "cannot tell"


def _header(study: Study, out: Path, command: str) -> list[str]:
    """The title, the command, the commits and what each arm ran."""
    lines: list[str] = []
    lines += [
        f"# Study: {study.name}",
        "",
        study.description.strip(),
        "",
        f"- command: `{command}`",
        f"- git commit (this report): `{git_commit()}`",
        f"- git commit(s) the runs were trained at: {_run_commits_line(study, out)}",
        *_reused_line(study, out),
        f"- seeds: {study.seeds}; iterations per run: {study.iterations}"
        + (" (a cap: the runs stop on run.budget_minutes, see the iterations column)" if _budgeted(study, out) else "")
        + (
            f"; periodic eval every {study.eval_every} iterations on {study.eval_subset} tag-balanced held-out "
            "prompts (ODE, run.eval_steps steps, run.eval_guidance, fixed noise; see each run's config.yaml)"
            if study.eval_every
            else "; no periodic evaluations"
        )
        + "; final eval on the whole of the run's eval prompts (run.eval_prompts; see the final table's title).",
        "- arms: "
        + "; ".join(f"**{r.name}** = `{r.preset} {' '.join(study.overrides + r.overrides)}`" for r in study.runs),
        "",
    ]
    return lines


def _curves(study: Study, runs: dict[str, list[dict[str, Any]]], out: Path, max_it: float) -> list[str]:
    """curves.png (train reward by iteration and seconds; periodic held-out strict) and eval_reward.png."""
    import matplotlib.pyplot as plt

    lines: list[str] = []
    # --- curves -----------------------------------------------------------------------------------------------
    max_sec = max((float(r["seconds"][-1]) for rs in runs.values() for r in rs if len(r["seconds"])), default=1.0)
    periodic = bool(study.eval_every)
    fig, axes = plt.subplots(2 if periodic else 1, 2, figsize=(11, 8 if periodic else 4.2), squeeze=False)
    # the batch mean of 64 samples is noisy: a 10-iteration running mean per run before the band over seeds
    smooth = {n: [{**r, "reward": _running_mean(r["reward"], 10)} for r in rs] for n, rs in runs.items()}
    _band_plot(axes[0, 0], smooth, "iteration", "reward", "train reward (batch mean, 10-it. running mean)", max_it)
    _band_plot(axes[0, 1], smooth, "seconds", "reward", "train reward (batch mean, 10-it. running mean)", max_sec)
    if periodic:
        _band_plot(axes[1, 0], runs, "eval_iteration", "eval_strict", "held-out strict accuracy (subset)", max_it)
        _band_plot(axes[1, 1], runs, "eval_seconds", "eval_strict", "held-out strict accuracy (subset)", max_sec)
    fig.suptitle(f"{study.name.split(' — ')[0]}: mean and 95% band over seeds")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=90)
    plt.close(fig)
    if periodic:
        fig, axes1 = plt.subplots(1, 2, figsize=(11, 4))
        _band_plot(axes1[0], runs, "eval_iteration", "eval_reward", "held-out mean reward (subset)", max_it)
        _band_plot(axes1[1], runs, "eval_seconds", "eval_reward", "held-out mean reward (subset)", max_sec)
        fig.tight_layout()
        fig.savefig(out / "eval_reward.png", dpi=90)
        plt.close(fig)
    lines += ["## Curves", "", "![curves](curves.png)", ""]
    lines += ["![eval reward](eval_reward.png)", ""] if periodic else []
    return lines


def eval_split(runs: dict[str, list[dict[str, Any]]]) -> str:
    """The prompt set the runs' final evaluations used (eval.json settings), e.g. 'shapes:test'; 'mixed: a, b' if
    they differ, 'shapes:test' when none says (older eval.json)."""
    names = sorted({str(r["final"]["trained"].get("settings", {}).get("prompts", "shapes:test"))
                    for rs in runs.values() for r in rs if r["final"] and "trained" in r["final"]})
    if not names:
        return "shapes:test"
    return names[0] if len(names) == 1 else "mixed: " + ", ".join(names)


def _final_tables(runs: dict[str, list[dict[str, Any]]], baseline: str) -> list[str]:
    """The final held-out evaluation per arm, then each arm paired by seed against the baseline."""
    lines: list[str] = []
    # --- final numbers ------------------------------------------------------------------------------------------
    lines += [
        f"## Final held-out evaluation (all of {eval_split(runs)})",
        "",
        "| arm | seeds | reward (mean ± 95% CI) | strict overall | Δ reward vs initial | Δ strict vs initial | Δ "
        "strict per seed | iterations (mean) | train s (mean) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    delta = {
        name: {
            k: {r["seed"]: r["final"]["delta"][k] for r in rs if r["final"] and k in r["final"].get("delta", {})}
            for k in ("strict_overall", "reward_mean")
        }
        for name, rs in runs.items()
    }
    for name, rs in runs.items():
        fin = [r["final"] for r in rs if r["final"]]
        if not fin:
            lines.append(f"| {name} | 0 | – | – | – | – | – | – | – |")
            continue
        per_seed = " / ".join(f"{v:+.3f}" for _, v in sorted(delta[name]["strict_overall"].items())) or "–"
        rw = final_mean_ci([f["trained"]["reward_mean"] for f in fin])
        st = final_mean_ci([f["trained"].get("strict_overall", np.nan) for f in fin])
        dr = final_mean_ci([f["delta"]["reward_mean"] for f in fin if "delta" in f])
        ds = final_mean_ci([f["delta"].get("strict_overall", np.nan) for f in fin if "delta" in f])
        secs = np.mean([r["seconds"][-1] for r in rs if len(r["seconds"])])
        its = np.mean([r["iteration"][-1] for r in rs if len(r["iteration"])])
        lines.append(
            f"| {name} | {len(fin)} | {rw[0]:.4f} ± {rw[1]:.4f} | {st[0]:.4f} ± {st[1]:.4f} | {dr[0]:+.4f} ± "
            f"{dr[1]:.4f} | {ds[0]:+.4f} ± {ds[1]:.4f} | {per_seed} | {its:.0f} | {secs:.0f} |"
        )
    lines.append("")
    lines += [
        f"Paired by seed against **{baseline}** (runs of one seed share the prompt order, the initial noise and the "
        "evaluation noise, so the per-seed difference cancels what they have in common); mean ± 95% CI over the "
        "paired seeds. A CI that includes 0 means the study cannot tell the arm from the baseline; the verdict names "
        "a winner only where the CI excludes 0.",
        "",
        f"| arm | paired seeds | Δ strict − {baseline}'s | per seed | Δ reward − {baseline}'s | "
        "verdict (strict; reward) |",
        "|---|---|---|---|---|---|",
    ]
    for name in runs:
        if name == baseline or baseline not in delta:
            continue
        ms, hs, seeds, ds_ = paired_difference(delta[name]["strict_overall"], delta[baseline]["strict_overall"])
        mr, hr, _, _ = paired_difference(delta[name]["reward_mean"], delta[baseline]["reward_mean"])
        if not seeds:
            lines.append(f"| {name} | 0 | – | – | – | – |")
            continue
        lines.append(
            f"| {name} | {len(seeds)} | {ms:+.4f} ± {hs:.4f} | {' / '.join(f'{d:+.3f}' for d in ds_)} | {mr:+.4f} ± "
            f"{hr:.4f} | {verdict(ms, hs, len(seeds), name, baseline)}; "
            f"{verdict(mr, hr, len(seeds), name, baseline)} |"
        )
    lines.append("")
    return lines


def _per_tag(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Final strict accuracy per GenEval tag, mean over seeds."""
    lines: list[str] = []
    # --- per tag -----------------------------------------------------------------------------------------------
    tags: list[str] = []
    for rs in runs.values():
        for rec in rs:
            if rec["final"] and "strict_by_tag" in rec["final"]["trained"]:
                tags = list(rec["final"]["trained"]["strict_by_tag"])
                break
    if tags:
        lines += [
            "## Per-tag strict accuracy (final, mean over seeds)",
            "",
            "| arm | " + " | ".join(tags) + " |",
            "|---" * (len(tags) + 1) + "|",
        ]
        first = next((r["final"] for rs in runs.values() for r in rs if r["final"] and "base" in r["final"]), None)
        if first:
            lines.append(
                "| initial model | " + " | ".join(f"{first['base']['strict_by_tag'][t]:.3f}" for t in tags) + " |"
            )
        for name, rs in runs.items():
            fin = [r["final"]["trained"]["strict_by_tag"] for r in rs if r["final"]]
            if fin:
                lines.append(f"| {name} | " + " | ".join(f"{np.mean([f[t] for f in fin]):.3f}" for t in tags) + " |")
        lines.append("")
    return lines


def _cost(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Seconds, NFEs and reward calls per iteration, by phase."""
    lines: list[str] = []
    # --- cost --------------------------------------------------------------------------------------------------
    lines += [
        "## Cost per iteration (mean over iterations and seeds)",
        "",
        "| arm | seconds | NFE rollout | NFE estimates | NFE update | reward calls | phases (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        mets = [x for r in rs for x in r["metrics"]]
        if not mets:
            continue
        phases = sorted({k for x in mets for k in x.get("seconds", {})})
        ph = ", ".join(f"{p} {np.mean([x['seconds'].get(p, 0.0) for x in mets]):.2f}" for p in phases)

        def g(k: str, mets: list[dict[str, Any]] = mets) -> float:
            return float(np.mean([x.get(k, 0) for x in mets]))

        lines.append(
            f"| {name} | {g('seconds_total'):.2f} | {g('nfe_rollout'):.0f} | {g('nfe_estimates'):.0f} | "
            f"{g('nfe_update'):.0f} | {g('reward_calls'):.0f} | {ph} |"
        )
    lines.append("")
    return lines


def _credit_diagnostics(runs: dict[str, list[dict[str, Any]]], out: Path, max_it: float) -> list[str]:
    """diagnostics.png and a table: zero-std group ratio and ADAE's absolute share."""
    import matplotlib.pyplot as plt

    lines: list[str] = []
    # --- credit diagnostics: zero-std groups (where group advantages vanish) and ADAE's absolute share ---------
    diag_keys = [
        k
        for k in ("credit/zero_std_group_ratio", "credit/abs_share")
        if any(k in x for rs in runs.values() for r in rs for x in r["metrics"])
    ]
    if diag_keys:
        for rec in (rec for rs in runs.values() for rec in rs):
            for k in diag_keys:
                rec[k] = np.array([x.get(k, np.nan) for x in rec["metrics"]], dtype=float)
        fig, axes = plt.subplots(1, len(diag_keys), figsize=(5.5 * len(diag_keys), 4), squeeze=False)
        for ax, k in zip(axes[0], diag_keys):
            has = {n: [r for r in rs if np.all(np.isfinite(r[k]))] for n, rs in runs.items()}
            _band_plot(ax, {n: rs for n, rs in has.items() if rs}, "iteration", k, k.split("/")[-1], max_it)
        fig.tight_layout()
        fig.savefig(out / "diagnostics.png", dpi=90)
        plt.close(fig)
        lines += [
            "## Credit diagnostics",
            "",
            "zero_std_group_ratio: fraction of the iteration's groups whose final rewards are all equal (their "
            "group-relative advantage is 0); abs_share: share of |advantage| that comes from ADAE's absolute term k·Q "
            "(VGPO).",
            "",
            "![diagnostics](diagnostics.png)",
            "",
            "| arm | " + " | ".join(f"{k.split('/')[-1]} (mean)" for k in diag_keys) + " |",
            "|---" * (len(diag_keys) + 1) + "|",
        ]
        for name, rs in runs.items():
            vals = []
            for k in diag_keys:
                v = np.concatenate([r[k] for r in rs]) if rs else np.array([np.nan])
                vals.append("–" if not np.any(np.isfinite(v)) else f"{np.nanmean(v):.3f}")
            lines.append(f"| {name} | " + " | ".join(vals) + " |")
        lines.append("")
    return lines


def _gain_section(runs: dict[str, list[dict[str, Any]]], out: Path) -> list[str]:
    """gain_per_step.png (Stepwise Fig. 2 analogue) and the non-monotone fraction of ρ."""
    import matplotlib.pyplot as plt

    lines: list[str] = []
    # --- Fig. 2 analogue: mean |gain| per step; non-monotone ρ ----------------------------------------------------
    gain_runs = {
        n: [
            x["credit/gain_abs_mean_per_step"]
            for r in rs
            for x in r["metrics"]
            if "credit/gain_abs_mean_per_step" in x
        ]
        for n, rs in runs.items()
    }
    gain_runs = {n: gains for n, gains in gain_runs.items() if gains}
    if gain_runs:
        fig, ax = plt.subplots(figsize=(6, 4))
        for n, gains in gain_runs.items():
            arr = np.array(gains)
            ax.plot(np.arange(arr.shape[1]), arr.mean(0), marker="o", label=n)
        ax.set_xlabel("step index j (t = 1 → 0)")
        ax.set_ylabel("mean |gain| = |ρ_{j+1} − ρ_j|")
        ax.set_title("Fig. 2 analogue: gain magnitude per step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "gain_per_step.png", dpi=90)
        plt.close(fig)
        lines += ["## Gain magnitude per step (Stepwise Fig. 2 analogue)", "", "![gains](gain_per_step.png)", ""]
        for n, rs in runs.items():
            nm = [
                x["credit/rho_nonmonotone_frac"]
                for r in rs
                for x in r["metrics"]
                if "credit/rho_nonmonotone_frac" in x
            ]
            if nm:
                lines.append(
                    f"- {n}: fraction of trajectories whose intermediate reward ρ_j is non-monotone in j: "
                    f"{np.mean(nm):.3f}"
                )
        lines.append("")
    return lines


def _trajectory_figure(study: Study, out: Path) -> list[str]:
    """reward_trajectories.png (Stepwise Fig. 1 analogue) of the figure run, if any."""
    lines: list[str] = []
    if study.figure_run:
        arm = next(r for r in study.runs if r.name == study.figure_run)
        try:
            reward_trajectory_figure(run_dir(out, arm, study.seeds[0]), out / "reward_trajectories.png")
            lines += [
                "## Intermediate reward trajectories (Stepwise Fig. 1 analogue)",
                "",
                f"Two samples of one prompt (shared x_T) from the final `{arm.name}` checkpoint (seed "
                f"{study.seeds[0]}): ρ_j of the x̂0 estimate of every state, with the estimates shown below "
                "the curve.",
                "",
                "![trajectories](reward_trajectories.png)",
                "",
            ]
        except Exception as e:  # noqa: BLE001  (the report must not die on an optional figure)
            lines += [f"(Fig. 1 analogue not drawn: {e})", ""]
    return lines


def write_report(study: Study, out: Path, command: str, figure: bool = True) -> Path:
    """report.md (+ figures) of a finished study under `out`: one section per helper below."""
    import matplotlib

    matplotlib.use("Agg")
    runs: dict[str, list[dict[str, Any]]] = {}
    for arm_run in study.runs:
        runs[arm_run.name] = [
            {**load_run(run_dir(out, arm_run, s)), "seed": s}
            for s in study.seeds
            if (run_dir(out, arm_run, s) / "metrics.jsonl").exists()
        ]
    baseline = study.baseline or study.runs[0].name
    ran = [float(r["iteration"][-1]) for rs in runs.values() for r in rs if len(r["iteration"])]
    max_it = max(ran) if ran else float(study.iterations)  # a budgeted study's cap is not what the runs did
    lines = _header(study, out, command) + _curves(study, runs, out, max_it) + _final_tables(runs, baseline)
    if study.eval_every and any(study.targets.values()):
        lines += _time_to_target(study, runs, baseline)
    lines += _per_tag(runs) + _cost(runs) + dynamics_table(runs)
    lines += _credit_diagnostics(runs, out, max_it) + _gain_section(runs, out)
    if figure:
        lines += _trajectory_figure(study, out)
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _time_to_target(study: Study, runs: dict[str, list[dict[str, Any]]], baseline: str) -> list[str]:
    """The time-to-target table of the periodic evaluations (improvement over each run's iteration-0 point)."""
    lines = [
        "## Time to target (periodic held-out evaluation)",
        "",
        "Targets are IMPROVEMENTS over the run's own iteration-0 evaluation (same prompts, same noise), so seeds "
        "whose evaluation noise starts higher or lower compare fairly. Mean over the seeds that reached the target "
        "(reached/seeds); ratio = arm ÷ baseline (< 1: faster).",
        "",
        "| curve | target Δ | arm | iterations | ratio | seconds | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, targets in study.targets.items():
        for tgt in targets:
            base_t = None
            rows = []
            for name, rs in runs.items():
                gain = lambda r, key=key: r[key] - r[key][0]  # noqa: E731  (improvement over the initial model)
                ti = summarize_times([time_to_target(r["eval_iteration"], gain(r), tgt) for r in rs if len(r[key])])
                ts = summarize_times([time_to_target(r["eval_seconds"], gain(r), tgt) for r in rs if len(r[key])])
                rows.append((name, ti, ts))
                if name == baseline:
                    base_t = (ti, ts)
            for name, ti, ts in rows:
                fmt = lambda s: "never" if s["mean"] is None else f"{s['mean']:.1f} ({s['reached']}/{s['seeds']})"  # noqa: E731
                ri = ratio(ti["mean"], base_t[0]["mean"]) if base_t else None
                rsec = ratio(ts["mean"], base_t[1]["mean"]) if base_t else None
                lines.append(
                    f"| {key} | {tgt} | {name} | {fmt(ti)} | {'–' if ri is None else f'{ri:.2f}'} | {fmt(ts)} | "
                    f"{'–' if rsec is None else f'{rsec:.2f}'} |"
                )
    lines.append("")
    return lines
