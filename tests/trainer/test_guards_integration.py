"""Hacking guards in the trainer: diversity is logged every iteration; the gold reward and the alarm every N."""

import json

from flowcredit.cli.main import main
from flowcredit.models.tiny import TinyDiTConfig, TinyFlowModel


def test_gold_reward_and_diversity_are_logged(tmp_path):
    TinyFlowModel(TinyDiTConfig(width=32, depth=1, heads=2)).save(tmp_path, name="m")
    run = tmp_path / "run"
    rc = main(
        [
            "train",
            f"model.path={tmp_path / 'm.safetensors'}",
            "model.precision=fp32",
            "data.prompts_per_iter=2",
            "data.group_size=2",
            "sampler.num_steps=2",
            "run.iterations=2",
            "run.eval_at_end=false",
            "run.grid_every=0",
            "reward.name=imagestats",
            "run.gold_reward=shapes",
            "run.gold_every=1",
            "run.gold_limit=4",
            "run.eval_steps=2",
            f"run.out_dir={run}",
        ]
    )
    assert rc == 0
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["diversity"] >= 0 for m in metrics) and len(metrics) == 2
    gold = [json.loads(x) for x in (run / "gold.jsonl").read_text().splitlines()]
    assert [g["iteration"] for g in gold] == [1, 2]
    assert all(0.0 <= g["gold"] <= 1.0 and isinstance(g["alarm"], bool) for g in gold)
    # each point's standard error (std / sqrt(4 prompts)) and the fall the alarm needed (run.alarm_noise_z = 2)
    assert all(g["gold_se"] >= 0.0 and g["gold_threshold"] >= 0.0 for g in gold)
    # the run-level alarm's look and z (run.alarm_alpha), and the per-look warning beside it
    assert [g["look"] for g in gold] == [0, 0] and all(isinstance(g["warning"], bool) for g in gold)
