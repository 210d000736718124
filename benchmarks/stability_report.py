"""Issue 23 item 4: does a long run of the default keep what it learns? Read a finished run folder and print the
checks: final full-test strict vs its best periodic evaluation, the hacking guard, per-tag changes.

    flowcredit train run.budget_minutes=60 run.iterations=100000 run.eval_every=100 run.gold_reward=shapes \
        run.gold_every=50 run.checkpoint_every=200 run.grid_every=200 run.out_dir=runs/stability60
    python benchmarks/stability_report.py runs/stability60 [--replay-alarm [--alarm-alpha A]] [--alarm-only]

The periodic evaluation (eval_curve.jsonl) scores run.eval_subset tag-balanced held-out prompts with the EMA weights;
the final one (eval.json) the whole held-out split, trained and shipped model on the same noise. Criteria (issue 23):
final strict ≥ best periodic strict − 0.03, no hacking alarm in gold.jsonl, no tag's strict accuracy down by more
than 0.05 from the shipped model.

--replay-alarm re-runs the hacking alarm of the current code (`rewards.guards.HackingAlarm`, with the run's
run.alarm_* settings or today's defaults) over the gold records kept in the run's last checkpoint (per-image scores
included) and the training reward / diversity of metrics.jsonl, so a run made before a change of the alarm can be
judged by the alarm as it is now. A run made before run.alarm_alpha existed gets today's default (0.05, the
alpha-spending rule); --alarm-alpha A overrides it (0 = the fixed per-look run.alarm_noise_z).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument(
        "--replay-alarm", action="store_true", help="re-run today's alarm over the checkpoint's gold records"
    )
    ap.add_argument("--alarm-alpha", type=float, default=None,
                    help="replay with this run.alarm_alpha (0 = the per-look noise_z test); default: the run's own")
    ap.add_argument("--alarm-only", action="store_true",
                    help="only the gold guard (runs without a final or periodic evaluation, e.g. a hacking probe)")
    a = ap.parse_args()
    metrics = [json.loads(x) for x in (a.run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    gold_f = a.run / "gold.jsonl"
    gold = [json.loads(x) for x in gold_f.read_text().splitlines() if x.strip()] if gold_f.exists() else []
    if a.alarm_only:
        fired = [g["iteration"] for g in gold if g.get("alarm")]
        print(f"run: {a.run}  iterations: {len(metrics)}  gold points: {len(gold)}  alarms logged by the run: "
              f"{len(fired)}" + (f" (iterations {fired})" if fired else ""))
        if a.replay_alarm:
            replay_alarm(a.run, metrics, a.alarm_alpha)
        return
    ev = json.loads((a.run / "eval.json").read_text())
    curve = [json.loads(x) for x in (a.run / "eval_curve.jsonl").read_text().splitlines() if x.strip()]

    train_s = sum(m["seconds_total"] for m in metrics)
    print(f"run: {a.run}  iterations: {len(metrics)}  training seconds: {train_s:.0f}")
    print("periodic evaluation (subset): iteration: strict / reward")
    print("  " + ", ".join(f"{c['iteration']}: {c['eval_strict']:.3f} / {c['eval_reward']:.3f}" for c in curve))
    best = max(curve[1:] or curve, key=lambda c: c["eval_strict"])
    final = ev["trained"]["geneval"]["strict"]["overall"]
    base = ev["base"]["geneval"]["strict"]["overall"]
    ok_keep = final >= best["eval_strict"] - 0.03
    print(f"final full-test strict {final:.3f} (shipped {base:.3f}, Δ {final - base:+.3f}); best periodic "
          f"{best['eval_strict']:.3f} at iteration {best['iteration']}: "
          f"final ≥ best − 0.03: {'yes' if ok_keep else 'NO'}")
    print(f"final full-test mean reward {ev['trained']['reward_mean']:.3f} (shipped {ev['base']['reward_mean']:.3f}, "
          f"Δ {ev['trained']['reward_mean'] - ev['base']['reward_mean']:+.3f})")
    alarms = [g for g in gold if g.get("alarm")]
    if gold:
        print(f"gold reward ({len(gold)} points): first {gold[0]['gold']:.3f}, last {gold[-1]['gold']:.3f}, "
              f"max {max(g['gold'] for g in gold):.3f}; alarms: {len(alarms)}"
              + (f" (first at iteration {alarms[0]['iteration']}: {alarms[0].get('message', '')})" if alarms else ""))
    else:
        print("gold reward: not configured (run.gold_reward)")
    if a.replay_alarm:
        replay_alarm(a.run, metrics, a.alarm_alpha)
    worst = 0.0
    parts = []
    for tag, t in ev["trained"]["geneval"]["strict"]["tags"].items():
        b = ev["base"]["geneval"]["strict"]["tags"][tag]["accuracy"]
        d = t["accuracy"] - b
        worst = min(worst, d)
        parts.append(f"{tag} {b:.2f}→{t['accuracy']:.2f} ({d:+.2f})")
    print("strict per tag, shipped → RL: " + ", ".join(parts))
    print(f"largest tag loss {worst:+.2f}: no tag down by more than 0.05: {'yes' if worst >= -0.05 else 'NO'}")
    blocks = [metrics[i : i + 100] for i in range(0, len(metrics), 100)]
    print("training, mean per 100 iterations: reward / strict / flow-matching error of own samples / grad norm / lr")
    def mean(blk: list[dict], k: str) -> float:
        return sum(m.get(k, 0.0) or 0.0 for m in blk) / len(blk)

    for blk in blocks:
        f = lambda k, blk=blk: mean(blk, k)  # noqa: E731
        print(f"  {blk[0]['iteration']:>5}-{blk[-1]['iteration']:<5} {f('reward_mean'):.3f} {f('strict_mean'):.3f} "
              f"{f('fm_mse'):.3f} {f('grad_norm'):.3f} {f('lr'):.2e}")


def replay_alarm(run: Path, metrics: list[dict], alpha: float | None = None) -> None:
    """Print what today's HackingAlarm says at every gold point of the run (module docstring)."""
    import dataclasses

    import yaml

    from flowcredit.config.schema import RunCfg
    from flowcredit.rewards.guards import GoldRecord
    from flowcredit.trainer.harness import HackingGuard

    ckpts = sorted((run / "checkpoints").glob("iter*/state.json"))
    if not ckpts:
        print("replay: no checkpoint with the gold records")
        return
    state = json.loads(ckpts[-1].read_text())["state"]
    records = [GoldRecord(**r) for r in state.get("harness", {}).get("guard", {}).get("gold", {}).get("records", [])]
    rc = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("run", {})
    # the run's alarm settings; those it predates take today's defaults (RunCfg's)
    cfg = RunCfg(**{k: v for k, v in rc.items() if k.startswith("alarm_") and k in RunCfg.__dataclass_fields__})
    if alpha is not None:
        cfg = dataclasses.replace(cfg, alarm_alpha=alpha)
    alarm = HackingGuard.alarm_from_config(cfg)
    by_it = {m["iteration"]: m for m in metrics}
    fired: list[int] = []
    warned: list[int] = []
    rule = f"run-level alpha {alarm.alpha:g}" if alarm.alpha is not None else f"per-look noise_z {alarm.noise_z:g}"
    print(f"replayed alarm ({ckpts[-1].parent.name}, {len(records)} gold points, window {alarm.window}, "
          f"{rule}, gold_drop {alarm.gold_drop:g}):")
    last = 0
    for rec in records:
        for it in range(last + 1, rec.iteration + 1):
            if it in by_it:
                alarm.update_train(it, by_it[it]["reward_mean"])
                alarm.update_diversity(it, by_it[it].get("diversity", 0.0))
        last = rec.iteration
        alarm.update_gold(rec.iteration, rec.mean, se=rec.se, scores=rec.scores)
        st = alarm.check()
        fired += [rec.iteration] if st.fired else []
        warned += [rec.iteration] if st.warning else []
        print(f"  {rec.iteration:>5}: gold {rec.mean:.3f}  {'ALARM ' if st.fired else ''}{st.message}")
    print(f"replayed alarms: {len(fired)}" + (f" (iterations {fired})" if fired else "")
          + f"; per-look warnings: {len(warned)}" + (f" (iterations {warned})" if warned else ""))


if __name__ == "__main__":
    main()
