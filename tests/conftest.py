"""Shared test fixtures: a fixed global seed, the thread count restored after each test, the tiny ToyFlowModel and
a CPU generator."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# Make ``import flowcredit`` work without an editable install, and ``from toy_model import ToyFlowModel`` from any
# test directory (paths are relative to this file).
_TESTS_DIR = Path(__file__).resolve().parent
for _path in (_TESTS_DIR.parent / "src", _TESTS_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from toy_model import ToyFlowModel  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_everything():
    """Fixed global seed for every test (torchtune style)."""
    torch.manual_seed(16)
    yield


@pytest.fixture(autouse=True)
def _restore_threads():
    """Runs call torch.set_num_threads(run.threads); restore the count so later tests see the default."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def toy_model() -> ToyFlowModel:
    """A tiny deterministic FlowModel over (3, 4, 4) latents, in eval mode."""
    return ToyFlowModel().eval()


@pytest.fixture
def cpu_generator() -> torch.Generator:
    return torch.Generator("cpu").manual_seed(0)
