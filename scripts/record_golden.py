"""Record (or check) the golden metrics of a 3-iteration seeded run of each GRPO preset (issue 22 item 6).

    python scripts/record_golden.py            # check against tests/trainer/golden/*.jsonl
    python scripts/record_golden.py --record   # overwrite them (only when behaviour is MEANT to change)

Small settings: shipped tiny model, fp32, one thread, 2 prompts × 4 samples, 4 SDE steps, no evaluation.
`tests/trainer/test_golden.py` runs the same function and compares every non-timing field.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

GOLDEN_DIR = ROOT / "tests" / "trainer" / "golden"
PRESETS = ("tiny_flow_grpo", "tiny_stepwise", "tiny_vgpo")
SMALL = [
    "model.precision=fp32", "sampler.num_steps=4", "data.prompts_per_iter=2", "data.group_size=4",
    "run.iterations=3", "run.threads=1", "run.eval_at_end=false", "run.eval_every=0", "run.grid_every=0",
    "run.checkpoint_every=0", "run.budget_minutes=0", "run.seed=7", "estimate.chunk_size=64",
]
TIMING = ("seconds",)  # keys whose values are wall-clock times (prefix match)


def run_preset(preset: str, out_dir: Path) -> list[dict]:
    from flowcredit.cli.main import PRESET_DIR
    from flowcredit.config import load_config
    from flowcredit.config.schema import TrainConfig
    from flowcredit.trainer.loop import Trainer

    cfg = load_config(TrainConfig, preset, SMALL + [f"run.out_dir={out_dir}"], preset_dirs=[PRESET_DIR])
    tr = Trainer(cfg, preset_name=preset)
    tr.setup()
    tr.train()
    return [strip_timing(json.loads(line)) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def strip_timing(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not any(k.startswith(p) for p in TIMING)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    bad = 0
    for preset in PRESETS:
        with tempfile.TemporaryDirectory() as tmp:
            recs = run_preset(preset, Path(tmp) / "run")
        f = GOLDEN_DIR / f"{preset}.jsonl"
        if args.record:
            f.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in recs))
            print(f"recorded {f.name}: {len(recs)} iterations")
            continue
        gold = [json.loads(x) for x in f.read_text().splitlines()]
        same = gold == recs
        bad += not same
        print(f"{preset}: {'identical' if same else 'DIFFERENT'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
