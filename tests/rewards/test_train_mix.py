"""A mixed reward (shapes verifier + image statistics, GDPO-style normalization) trains the tiny model end to end
through the CLI, and every component is logged separately."""

from __future__ import annotations

import json

import torch

from flowcredit.cli.main import main
from flowcredit.models.tiny import TinyDiTConfig, TinyFlowModel


def test_train_with_mixed_reward(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = TinyFlowModel(TinyDiTConfig(width=32, depth=1, heads=2)).save(tmp_path / "model", name="m")
    threads = torch.get_num_threads()
    try:
        rc = main([
            "train", f"model.path={model}", "model.precision=fp32", "reward.name=mix",
            "reward.components=[{name: shapes, weight: 0.8}, {name: imagestats, weight: 0.2}]", "reward.normalize=batch",
            "data.prompts_per_iter=2", "data.group_size=2", "sampler.num_steps=2", "run.iterations=2", "run.threads=1",
            "run.eval_prompts=shapes:test_unique", "run.eval_steps=2", "run.grid_every=0", f"run.out_dir={tmp_path / 'run'}",
        ])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward_mean" in r and "iteration" in r and "eval_reward" not in r]
    assert len(train) >= 2, rows
    last = train[-1]
    for key in ("shapes_mean", "shapes/strict_mean", "imagestats_mean", "imagestats/brightness_mean", "shapes/norm_mean"):
        assert key in last, sorted(last)
