"""Pretraining of the tiny model: run folder contents, resumption and bit-exact determinism of resume, the time
limit, rendering in worker processes, devices and bad settings."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flowcredit.cli.main import main
from flowcredit.models.pretrain import PretrainConfig, pretrain, resolve_device, sample_t
from flowcredit.models.tiny import TinyDiTConfig, TinyFlowModel
from flowcredit import checkpoints as checkpoint


def _cfg(out, steps):
    return PretrainConfig(
        out_dir=str(out), steps=steps, batch_size=4, model={"width": 32, "depth": 1, "heads": 2},
        checkpoint_every=2, log_every=1, precision="fp32", threads=1,
    )


def _state(out):
    """The newest checkpoint of a pretraining run folder (checkpoints/stepNNNNNN/, safetensors + JSON)."""
    return checkpoint.load(checkpoint.find_latest(out / "checkpoints", prefix="step"))


def _log(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 3-step run resumed to 5 steps, and a straight 5-step run."""
    base = tmp_path_factory.mktemp("pretrain")
    resumed, straight = base / "resumed", base / "straight"
    # The initial weights come from cfg.seed (test_seed_determines_initial_weights), whatever the global RNG holds.
    torch.manual_seed(0)
    pretrain(_cfg(resumed, 3), progress=False)
    after3 = {"log": _log(resumed), "state": _state(resumed)}
    pretrain(_cfg(resumed, 5), progress=False)
    torch.manual_seed(0)
    pretrain(_cfg(straight, 5), progress=False)
    return resumed, straight, after3


def test_run_folder_contents(runs):
    resumed, _, after3 = runs
    assert [r["step"] for r in after3["log"]] == [1, 2, 3]
    assert after3["state"]["step"] == 3
    for r in after3["log"]:
        assert set(r) >= {"step", "loss", "grad_norm", "lr", "elapsed_s"}
        assert r["loss"] > 0 and torch.isfinite(torch.tensor(r["loss"]))
    assert json.loads((resumed / "config.json").read_text())["steps"] == 5
    snaps = sorted(p.name for p in (resumed / "ema").glob("*.safetensors"))
    # snapshots every checkpoint_every steps and at the end of each run
    assert snaps == ["step000002.safetensors", "step000003.safetensors", "step000004.safetensors", "step000005.safetensors"]
    meta = json.loads((resumed / "ema" / "step000004.json").read_text())
    assert meta["step"] == 4 and meta["config"]["width"] == 32


def test_resume_continues_from_checkpoint(runs):
    resumed, _, _ = runs
    assert [r["step"] for r in _log(resumed)] == [1, 2, 3, 4, 5]
    assert _state(resumed)["step"] == 5
    assert not list(resumed.glob("**/*.tmp"))  # atomic writes leave no temp file
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step000004", "step000005"]  # keep=2


def test_resume_is_bit_exact(runs):
    resumed, straight, _ = runs
    a = _state(resumed)
    b = _state(straight)
    for key in ("model", "ema"):
        assert a[key].keys() == b[key].keys()
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)
    la, lb = _log(resumed), _log(straight)
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]
    ea = load_file(str(resumed / "ema" / "step000005.safetensors"))
    eb = load_file(str(straight / "ema" / "step000005.safetensors"))
    assert all(torch.equal(ea[k], eb[k]) for k in ea)
    # and training did move the weights
    s3 = runs[2]["state"]["model"]
    assert any(not torch.equal(s3[k], a["model"][k]) for k in s3)


def test_logged_lr_is_the_lr_used(runs):
    resumed, _, _ = runs
    cfg = _cfg(resumed, 5)
    for r in _log(resumed):
        used = cfg.lr * min(1.0, r["step"] / cfg.warmup)  # step s (1-based) ran with lr_at(s - 1)
        assert r["lr"] == pytest.approx(used)


def test_seed_determines_initial_weights(tmp_path):
    states = []
    for global_seed, name in ((1, "a"), (2, "b")):
        torch.manual_seed(global_seed)
        cfg = _cfg(tmp_path / name, 1)
        pretrain(cfg, progress=False)
        states.append(_state(tmp_path / name)["model"])
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_sample_t_range_and_shift():
    g = torch.Generator().manual_seed(0)
    t1 = sample_t(4096, 1.0, g)
    g = torch.Generator().manual_seed(0)
    t3 = sample_t(4096, 3.0, g)
    assert (t1 > 0).all() and (t1 < 1).all() and (t3 > 0).all() and (t3 < 1).all()
    assert t3.mean() > t1.mean()  # the shift moves mass towards noise (t = 1)
    assert abs(float(t1.mean()) - 0.5) < 0.02


def test_init_from_weights_continues_from_them(tmp_path):
    # lr = 0: one step leaves the weights exactly at the init weights, so the EMA snapshot equals them
    src = TinyFlowModel(TinyDiTConfig(width=32, depth=1, heads=2))
    src.save(tmp_path, name="init")
    out = tmp_path / "run"
    cfg = PretrainConfig(out_dir=str(out), steps=1, batch_size=2, lr=0.0, precision="fp32", threads=1, checkpoint_every=1,
                         log_every=1, init=str(tmp_path / "init.safetensors"))
    pretrain(cfg, progress=False)
    snap = TinyFlowModel.load(out / "ema" / "step000001.safetensors")
    for a, b in zip(snap.net.state_dict().values(), src.net.state_dict().values()):
        assert torch.equal(a, b)


def test_max_minutes_checkpoints_and_resume_finishes_identically(tmp_path, capsys):
    # a limit that is already spent after the first step: stop at step 1 with a checkpoint, then resume to the end
    cfg = _cfg(tmp_path / "limited", 3)
    cfg.max_minutes = 1e-9
    pretrain(cfg, progress=False)
    assert "stopped at step 1 of 3" in capsys.readouterr().out
    st = _state(tmp_path / "limited")
    assert st["step"] == 1 and (tmp_path / "limited" / "ema" / "step000001.safetensors").exists()
    cfg.max_minutes = 0.0
    pretrain(cfg, progress=False)
    pretrain(_cfg(tmp_path / "straight", 3), progress=False)
    a = _state(tmp_path / "limited")["model"]
    b = _state(tmp_path / "straight")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_worker_processes_render_the_batches(tmp_path):
    cfg = _cfg(tmp_path / "w", 3)
    cfg.workers = 1
    pretrain(cfg, progress=False)
    log = _log(tmp_path / "w")
    assert [r["step"] for r in log] == [1, 2, 3] and all(r["loss"] > 0 for r in log)
    # a different data stream from the in-process one (own generator), still a valid run that can be resumed
    pretrain(_cfg(tmp_path / "p", 3), progress=False)
    assert [r["loss"] for r in log] != [r["loss"] for r in _log(tmp_path / "p")]
    cfg.steps = 4
    pretrain(cfg, progress=False)
    assert _state(tmp_path / "w")["step"] == 4


@pytest.mark.parametrize("fast", [True, False])
def test_precision_auto_follows_the_hardware(tmp_path, monkeypatch, fast):
    import flowcredit.models.precision as precision_mod

    monkeypatch.setattr(precision_mod, "fast_bf16", lambda device="cpu": fast)
    cfg = PretrainConfig(out_dir=str(tmp_path / "p"), steps=1, batch_size=2, precision="auto", threads=1, checkpoint_every=1,
                         log_every=1, model={"width": 32, "depth": 1, "heads": 2})
    pretrain(cfg, progress=False)
    written = json.loads((tmp_path / "p" / "config.json").read_text())
    assert written["precision"] == "auto" and written["resolved_precision"] == ("bf16" if fast else "fp32")


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: 'cuda'.*CUDA is not available"):
            resolve_device("cuda")


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--workers", "-1"], ["workers: must be >= 0"]),
        (["--steps", "0"], ["steps: must be >= 1"]),
        (["--init", "no/such/model.safetensors"], ["init: 'no/such/model.safetensors' not found", "'shipped'"]),
        (["--max_minutes", "-2"], ["max_minutes: must be >= 0"]),
        (["--precision", "fp16"], ["precision: 'fp16' is not one of auto, fp32, bf16", "--precision auto"]),
    ],
)
def test_cli_bad_settings_one_line_and_nothing_written(tmp_path, capsys, args, fragments):
    out = tmp_path / "run"
    assert main(["pretrain", "--out_dir", str(out), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert not out.exists()


def test_cli_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in PretrainConfig.__dataclass_fields__:
        if flag != "model":
            assert f"--{flag}" in text
    assert "rerun the same command to continue" in text and "bit-exact resume" in text
