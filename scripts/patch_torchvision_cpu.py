#!/usr/bin/env python
"""Make PyPI's torchvision importable beside a CPU-only torch wheel (needed by easyocr for the `ocr` reward).

Why: with `torch==2.13.0` (CPU) pip resolves torchvision to 0.28.0, PyPI's CUDA build. Its C extension cannot load,
and `torchvision/__init__.py` then dies in `_meta_registrations` with
`RuntimeError: operator torchvision::nms does not exist`, so `import easyocr` fails too. This script edits one
import in `torchvision/__init__.py` so the two op-registration modules are imported only when the C extension
loaded. Transforms, models and utils (all easyocr uses) then work; only `torchvision.ops` C kernels (nms,
roi_align, ...) raise when called. The workaround was tested in `shared/docs/ENVIRONMENT.md` §1.

Usage (with the venv's python, after `pip install`):
    python scripts/patch_torchvision_cpu.py          # patch if needed; no-op when torchvision already imports
    python scripts/patch_torchvision_cpu.py --check  # exit 1 if `import torchvision` fails, change nothing

Idempotent; exits 0 when torchvision is absent (nothing to fix) or already importable.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

MARK = "# flowcredit: patched for CPU torch"
# The original statement imports the registration modules together with the public submodules.
_PATTERN = re.compile(r"from torchvision import \(\s*_autograd_registrations,\s*_meta_registrations,\s*")
_REPLACEMENT = (
    f"if extension._has_ops():  {MARK}\n"
    "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
    "from torchvision import (\n    "
)


def importable() -> tuple[bool, str]:
    """Try `import torchvision` in a fresh interpreter (a failed import poisons this one's module cache)."""
    r = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, text=True)
    return r.returncode == 0, (r.stderr.strip().splitlines() or [""])[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report whether torchvision imports")
    args = ap.parse_args(argv)
    spec = importlib.util.find_spec("torchvision")  # does not execute the package
    if spec is None or spec.origin is None:
        print("torchvision not installed: nothing to patch")
        return 0
    ok, err = importable()
    if ok:
        print(f"torchvision imports fine ({spec.origin}): nothing to patch")
        return 0
    if args.check:
        print(f"torchvision does not import: {err}\nfix: python scripts/patch_torchvision_cpu.py", file=sys.stderr)
        return 1
    path = Path(spec.origin)
    src = path.read_text()
    if MARK in src:
        print(f"already patched but still failing: {err}", file=sys.stderr)
        return 1
    new, n = _PATTERN.subn(_REPLACEMENT, src, count=1)
    if n != 1:
        print(f"unexpected layout of {path}; cannot patch (error was: {err})", file=sys.stderr)
        return 1
    path.write_text(new)
    ok, err = importable()
    if not ok:
        path.write_text(src)  # leave the install as we found it
        print(f"patch did not help ({err}); reverted {path}", file=sys.stderr)
        return 1
    print(f"patched {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
