"""The main job's evidence (issue B): run `flowcredit train` (the embedded default) for several seeds and print
its held-out improvement over the shipped model, wall time and peak memory per run.

    python benchmarks/main_job_seeds.py --seeds 0 1 2 [--out runs/main_job] [--parallel 1] [-- key=value ...]

Each run is a subprocess `flowcredit train <overrides> run.seed=S run.out_dir=<out>/seedS`; a finished run (its
eval.json exists) is reused, so the script can be resumed. With --parallel 2 two runs share the machine (each with
run.threads=1); their wall times are then not the default job's time, which is measured with --parallel 1.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default="runs/main_job")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    out = Path(a.out)
    procs: list[tuple[int, subprocess.Popen, float]] = []
    todo = [s for s in a.seeds if not (out / f"seed{s}" / "eval.json").exists()]
    walls: dict[int, float] = {}
    while todo or procs:
        while todo and len(procs) < a.parallel:
            s = todo.pop(0)
            d = out / f"seed{s}"
            d.mkdir(parents=True, exist_ok=True)
            extra = ["run.threads=1"] if a.parallel > 1 else []
            cmd = [sys.executable, "-m", "flowcredit.cli.main", "train", *a.overrides, *extra, f"run.seed={s}", f"run.out_dir={d}"]
            procs.append((s, subprocess.Popen(cmd, stdout=open(d / "stdout.log", "w"), stderr=subprocess.STDOUT), time.time()))
        time.sleep(2)
        for item in list(procs):
            s, p, t0 = item
            if p.poll() is not None:
                procs.remove(item)
                walls[s] = time.time() - t0
                # peak RSS of the largest child so far (Linux: KiB); exact per run with --parallel 1
                (out / f"seed{s}" / "resources.json").write_text(json.dumps(
                    {"wall_s": walls[s], "peak_rss_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 / 1024}))
                if p.returncode != 0:
                    print(f"seed {s} failed (exit {p.returncode}); see {out / f'seed{s}'}", file=sys.stderr)
    rows = []
    for s in a.seeds:
        d = out / f"seed{s}"
        if not (d / "eval.json").exists():
            continue
        ev = json.loads((d / "eval.json").read_text())
        res = json.loads((d / "resources.json").read_text()) if (d / "resources.json").exists() else {}
        rss, wall = res.get("peak_rss_gb"), res.get("wall_s")
        m = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        phases = {k: statistics.mean(r["seconds"].get(k, 0.0) for r in m) for k in m[0]["seconds"]}
        rows.append((s, ev, rss, wall, len(m), phases))
    print(f"{'seed':>4} {'iters':>5} {'wall s':>7} {'peak GB':>7} {'reward base→RL (Δ)':>26} {'strict base→RL (Δ)':>26}  s/iter by phase")
    for s, ev, rss, wall, n, ph in rows:
        b, t = ev["base"], ev["trained"]
        print(f"{s:>4} {n:>5} {wall or float('nan'):7.0f} {rss or float('nan'):7.2f} "
              f"{b['reward_mean']:.4f}→{t['reward_mean']:.4f} ({ev['delta']['reward_mean']:+.4f})   "
              f"{b['strict_overall']:.4f}→{t['strict_overall']:.4f} ({ev['delta']['strict_overall']:+.4f})  "
              + " ".join(f"{k}={v:.2f}" for k, v in ph.items()))
    if rows:
        dr = [r[1]["delta"]["reward_mean"] for r in rows]
        ds = [r[1]["delta"]["strict_overall"] for r in rows]
        print(f"mean Δreward {statistics.mean(dr):+.4f} (min {min(dr):+.4f}), mean Δstrict {statistics.mean(ds):+.4f} (min {min(ds):+.4f}) over {len(rows)} seeds")


if __name__ == "__main__":
    main()
