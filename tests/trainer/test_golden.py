"""Behaviour pinned across refactors (issue 22 item 6): a 3-iteration seeded run of each GRPO preset reproduces
the recorded metrics.jsonl in every non-timing field. Recorded with `python scripts/record_golden.py --record`.

Same machine: identical (the script's check mode compares exactly). Here floats are compared to 1e-4 relative,
so that a CI machine of another CPU kind (AVX2 vs AVX-512 kernels round differently) still passes."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("record_golden", ROOT / "scripts" / "record_golden.py")
rg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rg)


def _close(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys differ: {sorted(set(a) ^ set(b))}"]
        return [m for k in a for m in _close(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [m for i, (x, y) in enumerate(zip(a, b)) for m in _close(x, y, f"{path}[{i}]")]
    if isinstance(a, float) or isinstance(b, float):
        ok = math.isclose(float(a), float(b), rel_tol=1e-4, abs_tol=1e-6)
        return [] if ok else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


@pytest.mark.parametrize("preset", rg.PRESETS)
def test_golden_metrics(preset, tmp_path):
    gold = [json.loads(x) for x in (rg.GOLDEN_DIR / f"{preset}.jsonl").read_text().splitlines()]
    got = rg.run_preset(preset, tmp_path / "run")
    assert len(got) == len(gold) == 3
    diffs = _close(gold, got)
    assert not diffs, "\n".join(diffs[:20])
