"""Fixtures shared by the trainer tests that launch runs (distributed, faults, resume)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # dist_script, the subprocess entry point of these tests

import dist_script as ds  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_threads():
    """Runs call torch.set_num_threads(run.threads); restore the count so later tests see the default."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A small random tiny model saved once per module (test_grpo.py defines its own)."""
    return ds.make_model(tmp_path_factory.mktemp("model"))
