"""Fixtures shared by the trainer tests that launch runs (distributed, faults, resume)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # dist_script, the subprocess entry point of these tests

import dist_script as ds  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A small random tiny model saved once per module (test_loop.py defines its own)."""
    return ds.make_model(tmp_path_factory.mktemp("model"))
