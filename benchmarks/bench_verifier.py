"""Shapes verifier speed: ms per image (median over repeats, one thread) on ground-truth renders at 32 and 64 px.

Usage: python benchmarks/bench_verifier.py [--n 200] [--repeats 5]

The first pass over the images also builds the per-box-size template cache; it is reported separately ("cold")
and excluded from the median ("warm").
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from flowcredit.shapes import prompts, render  # noqa: E402
from flowcredit.shapes.verifier import verify  # noqa: E402


def bench(resolution: int, n: int, repeats: int) -> dict[str, float]:
    recs = prompts.make_splits(resolution)["test_lines"]
    step = max(len(recs) // n, 1)
    recs = recs[::step][:n]
    imgs = [render.render_record(r, seed=0, index=i, resolution=resolution) for i, r in enumerate(recs)]
    t0 = time.perf_counter()
    for im, r in zip(imgs, recs):
        verify(im, r)
    cold = (time.perf_counter() - t0) * 1000 / len(imgs)
    per_pass = []
    n_strict = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = [verify(im, r) for im, r in zip(imgs, recs)]
        per_pass.append((time.perf_counter() - t0) * 1000 / len(imgs))
        n_strict = sum(v.strict for v in res)
    return {"images": len(imgs), "cold_ms": cold, "warm_ms": statistics.median(per_pass), "strict": n_strict}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=240, help="ground-truth images per resolution (all tags)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    for res in (32, 64):
        r = bench(res, args.n, args.repeats)
        print(
            f"{res}x{res}: verify {r['warm_ms']:.2f} ms/image (median of {args.repeats} passes over {r['images']} "
            f"ground-truth images, 1 thread; first pass incl. template cache {r['cold_ms']:.2f} ms/image; "
            f"strict {r['strict']}/{r['images']})"
        )


if __name__ == "__main__":
    main()
