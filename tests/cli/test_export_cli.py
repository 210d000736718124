"""`flowcredit export` of a tiny-model run writes a .safetensors + JSON pair equal to the trained weights."""

import torch

from flowcredit.cli.inference import load_any_model
from flowcredit.cli.main import main
from flowcredit.models.tiny import TinyDiTConfig, TinyFlowModel


def test_export_tiny_run_round_trip(tmp_path):
    TinyFlowModel(TinyDiTConfig(width=32, depth=1, heads=2)).save(tmp_path, name="m")
    run = tmp_path / "run"
    rc = main(["train", f"model.path={tmp_path / 'm.safetensors'}", "model.precision=fp32", "data.prompts_per_iter=2",
               "data.group_size=2", "sampler.num_steps=2", "run.iterations=1", "run.eval_at_end=false", "run.grid_every=0",
               "optim.lr=1e-2", "reward.name=imagestats", f"run.out_dir={run}"])  # imagestats: diverse rewards even for a random model
    assert rc == 0
    assert main(["export", str(run), str(tmp_path / "out"), "--name", "rl"]) == 0
    exported = TinyFlowModel.load(tmp_path / "out" / "rl.safetensors")
    trained = load_any_model(str(run), "fp32")
    for (k, a), (_, b) in zip(exported.net.state_dict().items(), trained.net.state_dict().items()):
        assert torch.equal(a, b), k
    base = TinyFlowModel.load(tmp_path / "m.safetensors")
    assert any(not torch.equal(a, b) for a, b in zip(exported.net.parameters(), base.net.parameters()))
