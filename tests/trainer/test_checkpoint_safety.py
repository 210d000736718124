"""Checkpoints cannot run code: a crafted pickle whose unpickling would create a marker file goes, as a bare file and
inside a run folder, through every command that loads weights (eval, sample, export, train resume=, pretrain,
convert); the marker never appears and each command exits non-zero with one line. Also: the safetensors + JSON
format round-trips every state type, and files that are not what they claim are named in a one-line error."""

from __future__ import annotations

import builtins
import hashlib
import json
import pickle
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_script as ds

from flowcredit.cli.main import main
from flowcredit.config import load_config
from flowcredit.config.load import dump_yaml
from flowcredit.config.schema import TrainConfig
from flowcredit import checkpoints as checkpoint
from flowcredit.trainer.state import rng_states

PRESET_DIR = Path(checkpoint.__file__).resolve().parent / "configs"


class Payload:
    """Unpickling this object runs ``exec``, which creates ``marker``: what a malicious checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.exec, (f"open({self.marker!r}, 'w').close()",))


def write_torch_pickle(path: Path, marker: Path) -> Path:
    """A torch.save zip whose data.pkl carries the payload (what an old flowcredit .pt looks like, plus a payload)."""
    torch.save({"iteration": 3, "model": Payload(marker), "model_config": {}}, path)
    return path


def write_raw_pickle(path: Path, marker: Path) -> Path:
    with open(path, "wb") as f:
        pickle.dump({"model": Payload(marker)}, f)
    return path


@pytest.fixture()
def marker(tmp_path):
    m = tmp_path / "PAYLOAD_RAN"
    # sanity: unpickling the payload for real does create the marker, so its absence below means something
    pickle.loads(pickle.dumps(Payload(tmp_path / "sanity")))
    assert (tmp_path / "sanity").exists()
    return m


def run_folder(tmp_path: Path, model_path: Path, name: str = "run", model_name: str | None = None) -> Path:
    """A run folder as `flowcredit train` leaves it (config.yaml, checkpoints/), without training."""
    out = tmp_path / name
    (out / "checkpoints").mkdir(parents=True)
    cfg = load_config(TrainConfig, "tiny_flow_grpo", ds.overrides(model_path, out), preset_dirs=[PRESET_DIR])
    dump_yaml(cfg, out / "config.yaml")
    if model_name is not None:  # a real-model run (export goes through models/export.py)
        (out / "config.yaml").write_text(f"model:\n  name: {model_name}\n")
    return out


def one_line_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0, f"{argv} exited 0"
    lines = [ln for ln in err.splitlines() if ln.strip() and "Warning" not in ln and not ln.startswith("  ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def commands(target: Path, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "eval": ["eval", "--checkpoint", str(target), "--prompts", "shapes:test_unique", "--limit", "1",
                 "--steps", "1", "--out", str(tmp_path / "ev")],
        "sample": ["sample", "a photo of a red circle", "--checkpoint", str(target), "--steps", "1", "--n", "1",
                   "--out", str(tmp_path / "s.png")],
        "export": ["export", str(target), str(tmp_path / "exported")],
    }


# ---------------------------------------------------------------------------------------------------------------
# crafted pickles through every command that loads weights
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["torch_zip", "raw_pickle"])
@pytest.mark.parametrize("command", ["eval", "sample", "export"])
def test_bare_pickle_file_never_runs(tmp_path, marker, capsys, kind, command):
    bad = (write_torch_pickle if kind == "torch_zip" else write_raw_pickle)(tmp_path / "model.pt", marker)
    line = one_line_error(capsys, commands(bad, tmp_path)[command])
    assert str(bad) in line and "pickle" in line and "flowcredit convert --trust" in line
    assert not marker.exists()


@pytest.mark.parametrize("command", ["eval", "sample", "export"])
def test_pickle_disguised_as_safetensors_never_runs(tmp_path, marker, capsys, command):
    bad = write_torch_pickle(tmp_path / "model.safetensors", marker)
    (tmp_path / "model.json").write_text(json.dumps({"config": {}}))
    line = one_line_error(capsys, commands(bad, tmp_path)[command])
    assert str(bad) in line
    assert not marker.exists()


@pytest.mark.parametrize("command", ["eval", "sample", "export", "export_sd3", "resume"])
def test_run_folder_with_a_pickle_checkpoint_never_runs(tmp_path, model_path, marker, capsys, command):
    run = run_folder(tmp_path, model_path, model_name="sd3" if command == "export_sd3" else None)
    bad = write_torch_pickle(run / "checkpoints" / "iter000003.pt", marker)
    if command == "resume":
        line = one_line_error(capsys, ["train", f"resume={run}"])
        assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text()  # nothing trained
    else:
        line = one_line_error(capsys, commands(run, tmp_path)[command.split("_")[0]])
    assert "iter000003.pt" in line and "pickle" in line and "flowcredit convert --trust" in line
    assert not marker.exists()
    assert bad.exists()  # never deleted: it may be the only copy of a run


def _forge(folder: Path, files: dict[str, bytes]) -> None:
    """A checkpoint folder whose manifest vouches for ``files`` (a forger can always write a matching manifest)."""
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    man = {"format": checkpoint.FORMAT, "version": checkpoint.FORMAT_VERSION, "iteration": 3,
           "files": {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}}
    (folder / checkpoint.MANIFEST).write_text(json.dumps(man))


@pytest.mark.parametrize("forged", ["tensors_is_pickle", "state_is_pickle"])
@pytest.mark.parametrize("command", ["eval", "export", "resume"])
def test_forged_checkpoint_folder_with_pickles_inside_never_runs(tmp_path, model_path, marker, capsys, forged,
                                                                 command):
    run = run_folder(tmp_path, model_path)
    pk = tmp_path / "payload.pt"
    write_torch_pickle(pk, marker)
    good_state = json.dumps({"format": checkpoint.FORMAT, "version": 2, "iteration": 3, "state": {}}).encode()
    if forged == "tensors_is_pickle":
        files, named = {checkpoint.TENSORS: pk.read_bytes(), checkpoint.STATE: good_state}, checkpoint.TENSORS
    else:
        from safetensors.torch import save

        tensors = save({"x": torch.zeros(1)}, metadata={"flowcredit": checkpoint.FORMAT})
        files, named = {checkpoint.TENSORS: tensors, checkpoint.STATE: pk.read_bytes()}, checkpoint.STATE
    _forge(run / "checkpoints" / "iter000003", files)
    argv = ["train", f"resume={run}"] if command == "resume" else commands(run, tmp_path)[command]
    line = one_line_error(capsys, argv)
    assert str(run / "checkpoints" / "iter000003" / named) in line
    assert not marker.exists()


def test_pretrain_refuses_an_old_pickle_state(tmp_path, marker, capsys):
    out = tmp_path / "pre"
    out.mkdir()
    write_torch_pickle(out / "state.pt", marker)
    argv = ["pretrain", "--out_dir", str(out), "--steps", "1", "--batch_size", "2", "--threads", "1"]
    line = one_line_error(capsys, argv)
    assert "state.pt" in line and "flowcredit convert --trust" in line
    assert not marker.exists()


def test_convert_needs_trust_and_even_then_never_runs_a_payload(tmp_path, marker, capsys):
    bad = write_torch_pickle(tmp_path / "iter000003.pt", marker)
    line = one_line_error(capsys, ["convert", str(bad)])
    assert "--trust" in line and str(bad) in line
    line = one_line_error(capsys, ["convert", "--trust", str(bad)])
    assert "builtins.exec" in line and "not converted" in line
    raw = write_raw_pickle(tmp_path / "raw.pt", marker)
    assert "not converted" in one_line_error(capsys, ["convert", "--trust", str(raw), str(tmp_path / "raw_new")])
    assert not marker.exists() and not (tmp_path / "iter000003").exists()


# ---------------------------------------------------------------------------------------------------------------
# a trusted old checkpoint converts and resumes; the format round-trips every state type
# ---------------------------------------------------------------------------------------------------------------


def test_old_pt_checkpoint_converts_and_the_run_resumes(tmp_path, model_path, capsys):
    out = tmp_path / "run"
    first = ds.make_trainer(model_path, out, "run.iterations=1", "optim.ema_decay=0.5")
    first.train()
    # what flowcredit wrote before this format: torch.save of the same state dict
    state = checkpoint.load(out / "checkpoints" / "iter000001")
    import shutil

    shutil.rmtree(out / "checkpoints" / "iter000001")
    old = out / "checkpoints" / "iter000001.pt"
    torch.save(state, old)
    with pytest.raises(Exception, match="iter000001.pt: a pickle"):
        ds.make_trainer(model_path, out, "run.iterations=2", "optim.ema_decay=0.5")
    capsys.readouterr()
    assert main(["convert", "--trust", str(old)]) == 0
    assert "converted" in capsys.readouterr().out
    new = out / "checkpoints" / "iter000001"
    assert checkpoint.verify(new) is None and checkpoint.find_latest(out / "checkpoints") == new
    conv = checkpoint.load(new)
    assert conv.keys() == state.keys()
    assert all(torch.equal(conv["model"][k], state["model"][k]) for k in state["model"])
    resumed = ds.make_trainer(model_path, out, "run.iterations=2", "optim.ema_decay=0.5")
    assert resumed.iteration == 1
    resumed.train()
    straight = ds.make_trainer(model_path, tmp_path / "straight", "run.iterations=2", "optim.ema_decay=0.5")
    straight.train()
    a, b = resumed.model.net.state_dict(), straight.model.net.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_flatten_round_trips_every_state_type(tmp_path):
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), betas=(0.9, 0.99))
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    base = torch.arange(10.0)
    state = {
        "iteration": 7, "model": net.state_dict(), "optimizer": opt.state_dict(), "rng": rng_states(),
        "gen": torch.Generator().manual_seed(3).get_state(), "pcg": np.random.default_rng(5).bit_generator.state,
        "floats": [float("nan"), float("inf"), -0.0, 1e-300], "bytes": b"\x00\xff", "none": None, "flag": True,
        "view": base[2:5], "same_storage": (base, base[:2]), "int_keys": {3: "a", (1, 2): "b"},
        "bf16": torch.ones(2, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "np_scalar": np.float32(1.5), "__dunder__": {"x": 1},
    }
    path = checkpoint.save(state, tmp_path / "ck" / "iter000007", iteration=7)
    back = checkpoint.load(path)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert sorted(back["optimizer"]["state"]) == [0, 1]
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    opt2 = torch.optim.AdamW(net.parameters())
    opt2.load_state_dict(back["optimizer"])
    np.random.set_state(back["rng"]["numpy"])
    random.setstate(back["rng"]["python"])
    torch.set_rng_state(back["rng"]["torch"])
    assert np.random.get_state()[1].tolist() == state["rng"]["numpy"][1].tolist()
    assert torch.equal(back["gen"], state["gen"]) and back["pcg"] == state["pcg"]
    assert np.isnan(back["floats"][0]) and back["floats"][1:] == [float("inf"), -0.0, 1e-300]
    assert back["bytes"] == b"\x00\xff" and back["none"] is None and back["flag"] is True
    assert torch.equal(back["view"], base[2:5]) and torch.equal(back["same_storage"][1], base[:2])
    assert back["int_keys"] == {3: "a", (1, 2): "b"} and back["bf16"].dtype == torch.bfloat16
    assert back["scalar"].shape == () and back["empty"].shape == (0, 3) and back["np_scalar"] == 1.5
    assert back["__dunder__"] == {"x": 1}
    with pytest.raises(TypeError, match="'bad/obj': a object cannot be stored"):
        checkpoint.flatten({"bad": {"obj": object()}})


@pytest.mark.parametrize("damage", ["bad_json", "wrong_format", "missing_tensor", "not_flowcredit_safetensors"])
def test_files_that_are_not_what_they_claim_are_named(tmp_path, damage):
    from safetensors.torch import save

    path = checkpoint.save({"x": torch.arange(3)}, tmp_path / "ck" / "iter000001", iteration=1)
    state = json.loads((path / checkpoint.STATE).read_text())
    if damage == "bad_json":
        files, named = {checkpoint.STATE: b'{"format": "flowcredit-checkpoint", '}, checkpoint.STATE
    elif damage == "wrong_format":
        files, named = {checkpoint.STATE: json.dumps({**state, "format": "something-else"}).encode()}, checkpoint.STATE
    elif damage == "missing_tensor":
        state["state"]["y"] = {"__tensor__": "y"}
        files, named = {checkpoint.STATE: json.dumps(state).encode()}, checkpoint.STATE
    else:
        files, named = {checkpoint.TENSORS: save({"x": torch.arange(3)})}, checkpoint.TENSORS
    all_files = {n: (path / n).read_bytes() for n in checkpoint.FILES}
    all_files.update(files)
    forged = tmp_path / "forged" / "iter000001"
    _forge(forged, all_files)  # a manifest that matches: the content itself is wrong
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(forged)
    assert str(forged / named) in str(e.value) and "\n" not in str(e.value)


def test_interrupted_write_is_reported_and_ignored(tmp_path):
    d = tmp_path / "checkpoints"
    checkpoint.save({"x": torch.arange(1)}, d / "iter000001", iteration=1)
    (d / "iter000002.tmp").mkdir()
    (d / "iter000002.tmp" / checkpoint.TENSORS).write_bytes(b"partial")
    with pytest.warns(UserWarning, match="iter000002.tmp was interrupted before it completed; ignored"):
        assert checkpoint.find_latest(d) == d / "iter000001"
    checkpoint.save({"x": torch.arange(3)}, d / "iter000003", iteration=3)
    assert sorted(p.name for p in d.iterdir()) == ["iter000001", "iter000003"]  # the temp folder is cleaned up
