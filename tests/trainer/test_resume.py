"""Deterministic resume: kill -9 at random points of 5 phases, resume each time, and end bit-for-bit where an
uninterrupted run ends (weights, optimizer, metrics.jsonl, eval_curve.jsonl); torn/corrupt checkpoints are detected
and the newest intact one is used (none intact: a one-line error, never a silent restart); `flowcredit train
resume=RUN_DIR`."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_script as ds

from flowcredit import checkpoints as checkpoint

TIMING = ("seconds", "seconds_total", "eval_seconds")  # wall-clock fields: the only ones allowed to differ


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------------------
# kill -9 anywhere, resume, same result
# ---------------------------------------------------------------------------------------------------------------

ITERS, CK_EVERY, EVAL_EVERY = 6, 2, 2
# run.threads pins the thread count on both sides: the in-process run would otherwise inherit whatever an earlier
# test set (torch.set_num_threads), and fp32 reductions differ bitwise across thread counts.
CHAOS = (f"run.iterations={ITERS}", f"run.checkpoint_every={CK_EVERY}", f"run.eval_every={EVAL_EVERY}", "optim.ema_decay=0.5", "run.threads=1")
CHECKPOINTS = {i for i in range(1, ITERS + 1) if i % CK_EVERY == 0 or i == ITERS}
EVALS = {i for i in range(1, ITERS + 1) if i % EVAL_EVERY == 0}


def kill_plan(seed: int) -> list[tuple[str, int]]:
    """A random order of the phases rollout, reward, update, eval and one checkpoint-write point, each at a random
    iteration it can still reach (after the newest valid checkpoint), such that at least two kills resume from a
    checkpoint (not from scratch)."""
    rng = random.Random(seed)
    while True:
        ck_point = rng.choice(["checkpoint", "checkpoint_manifest"])  # before the rename / before the manifest
        phases = ["rollout", "reward", "update", "eval", ck_point]
        rng.shuffle(phases)
        ck, plan, from_checkpoint = 0, [], 0
        for ph in phases:
            valid = [i for i in range(ck + 1, ITERS + 1) if ph not in ("eval", ck_point) or i in (EVALS if ph == "eval" else CHECKPOINTS)]
            if not valid:
                break
            it = rng.choice(valid[:3])  # stay early enough for the phases still to come
            from_checkpoint += ck > 0
            plan.append((ph, it))
            ck = max([ck] + [c for c in CHECKPOINTS if c < it])
        else:
            if from_checkpoint >= 2:
                return plan


def test_kill9_in_every_phase_then_resume_is_bitwise_identical(tmp_path, model_path):
    # the uninterrupted run, in this process
    straight = ds.make_trainer(model_path, tmp_path / "straight", *CHAOS)
    straight.train()

    out = tmp_path / "chaos"
    cmd = [sys.executable, str(Path(ds.__file__)), str(model_path), str(out), *CHAOS]
    plan = kill_plan(seed=2021)  # reward:2, eval:4, rollout:5, update:5, checkpoint_manifest:6; runs start at 0, 0, 2, 4, 4
    seen_interrupted, resumed_from = False, []
    for phase, it in plan:
        env = ds.child_env()
        env["FLOWCREDIT_FAULT_INJECT"] = f"{phase}:{it}"
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == -9, f"{phase}:{it} was not reached (rc {proc.returncode}): {proc.stderr[-2000:]}"
        assert f"SIGKILL at {phase}:{it}" in proc.stderr
        resumed_from.append(int(proc.stderr.split("(iteration ")[1].split(")")[0]) if "resuming from" in proc.stderr else 0)
        seen_interrupted |= "was interrupted before it completed; ignored" in proc.stderr
    proc = subprocess.run(cmd, env=ds.child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen_interrupted |= "was interrupted before it completed; ignored" in proc.stderr
    assert sum(r > 0 for r in resumed_from) >= 2, resumed_from  # kills that resumed from a checkpoint, not from scratch

    final = checkpoint.load(out / "checkpoints" / f"iter{ITERS:06d}")
    a, b = straight.model.net.state_dict(), final["model"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), f"weights differ after kills at {plan}"
    for e, n in zip(straight.ema_weights.shadow, straight.trainable_names):
        assert torch.equal(e, final["ema"][n])
    st = straight.opt.state_dict()["state"]
    assert all(torch.equal(st[i]["exp_avg_sq"], final["optimizer"]["state"][i]["exp_avg_sq"]) for i in st)
    assert records(out / "metrics.jsonl") == records(tmp_path / "straight" / "metrics.jsonl")
    assert [r["iteration"] for r in records(out / "metrics.jsonl")] == list(range(1, ITERS + 1))  # no duplicates
    assert records(out / "eval_curve.jsonl") == records(tmp_path / "straight" / "eval_curve.jsonl")
    evals = [r["iteration"] for r in records(out / "eval_curve.jsonl")]
    assert set(evals) >= EVALS and evals == sorted(set(evals))  # no duplicates
    # a kill inside a checkpoint write leaves only a temp folder: reported, ignored, removed by the next write
    assert seen_interrupted
    assert not list((out / "checkpoints").glob("*.tmp"))


def test_kill_plan_covers_the_phases():
    for seed in range(20):
        plan = kill_plan(seed)
        assert {p for p, _ in plan} >= {"rollout", "reward", "update", "eval"}
        assert any(p.startswith("checkpoint") for p, _ in plan)


# ---------------------------------------------------------------------------------------------------------------
# torn / corrupt checkpoints
# ---------------------------------------------------------------------------------------------------------------


def _two_checkpoints(tmp_path, model_path, name):
    tr = ds.make_trainer(model_path, tmp_path / name, "run.checkpoint_every=1")
    tr.train()
    d = tmp_path / name / "checkpoints"
    assert sorted(p.name for p in d.iterdir()) == ["iter000001", "iter000002"]
    return d


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "edit_state", "no_manifest", "torn_manifest", "no_tensors"])
def test_damaged_latest_checkpoint_is_skipped(tmp_path, model_path, damage):
    d = _two_checkpoints(tmp_path, model_path, "run")
    latest = d / "iter000002"
    tensors, state = latest / checkpoint.TENSORS, latest / checkpoint.STATE
    if damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])
        why = "truncated"
    elif damage == "flip_byte":
        data = bytearray(tensors.read_bytes())
        data[len(data) // 2] ^= 0xFF
        tensors.write_bytes(bytes(data))
        why = "corrupt"
    elif damage == "edit_state":  # same size, one digit changed: only the checksum can tell
        text = state.read_text()
        i = text.index('"iteration": 2')
        state.write_text(text[:i] + '"iteration": 3' + text[i + 14 :])
        why = "state.json: sha256 differs"
    elif damage == "no_manifest":
        (latest / checkpoint.MANIFEST).unlink()
        why = "no manifest.json"
    elif damage == "torn_manifest":
        (latest / checkpoint.MANIFEST).write_text('{"bytes": 12')
        why = "unreadable manifest"
    else:
        tensors.unlink()
        why = "tensors.safetensors missing"
    with pytest.warns(UserWarning, match=f"iter000002 is unusable: .*{why}.*falling back to the newest intact one: .*iter000001"):
        resumed = ds.make_trainer(model_path, tmp_path / "run", "run.checkpoint_every=1")
    assert resumed.iteration == 1
    assert [r["iteration"] for r in records(tmp_path / "run" / "metrics.jsonl")] == [1]  # iteration 2 will be redone
    resumed.train()
    assert checkpoint.verify(latest) is None  # rewritten whole
    straight = ds.make_trainer(model_path, tmp_path / "straight", "run.checkpoint_every=1")
    straight.train()
    a, b = resumed.model.net.state_dict(), straight.model.net.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert records(tmp_path / "run" / "metrics.jsonl") == records(tmp_path / "straight" / "metrics.jsonl")


def test_all_checkpoints_damaged_is_an_error_not_a_restart(tmp_path, model_path, capsys):
    from flowcredit.cli.main import main
    from flowcredit.trainer.faults import TrainingError

    d = _two_checkpoints(tmp_path, model_path, "run")
    for p in d.glob("iter*/tensors.safetensors"):
        p.write_bytes(p.read_bytes()[:100])
    metrics_before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(TrainingError, match=r"no intact checkpoint in .*iter000002: .*truncated.*iter000001: .*truncated"):
        ds.make_trainer(model_path, tmp_path / "run", "run.checkpoint_every=1")
    # through the CLI: exit 2, one line, nothing trained or truncated
    capsys.readouterr()
    assert main(["train", f"resume={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot resume") and err.count("\n") == 1 and "no intact checkpoint" in err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics_before
    assert sorted(p.name for p in d.iterdir()) == ["iter000001", "iter000002"]  # nothing deleted


def test_checkpoint_write_protocol(tmp_path):
    path = tmp_path / "ck" / "iter000003"
    faults = []

    def fault(phase):  # at both hook points the checkpoint is not visible yet: only the temp folder exists
        faults.append(phase)
        assert not path.exists() and path.with_name("iter000003.tmp").is_dir()
        assert checkpoint.find_latest(path.parent, warn=False) is None

    checkpoint.save({"x": torch.arange(3)}, path, iteration=3, fault=fault)
    assert faults == ["checkpoint", "checkpoint_manifest"]
    man = json.loads(checkpoint.manifest_path(path).read_text())
    assert man["format"] == checkpoint.FORMAT and man["iteration"] == 3
    for name in (checkpoint.TENSORS, checkpoint.STATE):
        f = path / name
        assert man["files"][name] == {"bytes": f.stat().st_size, "sha256": checkpoint.sha256_file(f)}
    assert checkpoint.verify(path) is None and checkpoint.find_latest(path.parent) == path
    assert torch.equal(checkpoint.load(path)["x"], torch.arange(3))
    for i in (4, 5):
        checkpoint.save({"x": torch.arange(i)}, path.with_name(f"iter{i:06d}"), iteration=i, keep=2)
    assert sorted(p.name for p in path.parent.iterdir()) == ["iter000004", "iter000005"]


def test_truncate_jsonl_drops_later_and_torn_lines(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text('{"iteration": 1}\n{"iteration": 2}\n{"iteration": 3}\n{"itera')
    assert checkpoint.truncate_jsonl(f, 2) == 2
    assert f.read_text() == '{"iteration": 1}\n{"iteration": 2}\n'


# ---------------------------------------------------------------------------------------------------------------
# flowcredit train resume=RUN_DIR
# ---------------------------------------------------------------------------------------------------------------


def test_cli_resume_continues_the_run(tmp_path, model_path, capsys):
    from flowcredit.cli.main import main

    base = ds.overrides(model_path, tmp_path / "cli", "reward.name=dist_script:ImageMeanReward", "run.iterations=1")
    assert main(["train", "tiny_flow_grpo", *base]) == 0
    assert main(["train", f"resume={tmp_path / 'cli'}", "run.iterations=3"]) == 0
    out = capsys.readouterr().out
    assert f"run folder: {tmp_path / 'cli'}" in out and "done: 3 iterations" in out
    assert [r["iteration"] for r in records(tmp_path / "cli" / "metrics.jsonl")] == [1, 2, 3]
    assert (tmp_path / "cli" / "config.resumed.yaml").exists()

    straight = ds.make_trainer(model_path, tmp_path / "straight", "run.iterations=3")
    straight.train()
    final = checkpoint.load(tmp_path / "cli" / "checkpoints" / "iter000003")["model"]
    a = straight.model.net.state_dict()
    assert all(torch.equal(a[k], final[k]) for k in a)

    assert main(["train", f"resume={tmp_path / 'nothing'}"]) == 2
    assert "no config.yaml there" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# the checkpoint's state version (trainer/state.py: TrainState)
# ---------------------------------------------------------------------------------------------------------------


def _rewrite_state(path: Path, edit) -> None:
    """Load checkpoint `path`, apply `edit` to its state dict and save it back whole (a valid manifest)."""
    st = checkpoint.load(path)
    edit(st)
    tmp = path.with_name(path.name + ".edited")
    checkpoint.save(st, tmp, iteration=int(st["iteration"]))
    shutil.rmtree(path)
    tmp.rename(path)


def test_every_checkpoint_records_its_state_version(tmp_path, model_path):
    from flowcredit.trainer.state import STATE_VERSION

    d = _two_checkpoints(tmp_path, model_path, "run")
    assert STATE_VERSION == 2
    assert checkpoint.load(d / "iter000002")["state_version"] == 2


def test_a_version_1_checkpoint_resumes(tmp_path, model_path):
    """Version 1 had no version field and an unused generator state ("torch_rng"): it resumes, and the run ends
    where an uninterrupted one does."""
    d = _two_checkpoints(tmp_path, model_path, "run")
    shutil.rmtree(d / "iter000002")

    def to_v1(st):
        del st["state_version"]
        st["torch_rng"] = torch.Generator().manual_seed(0).get_state()

    _rewrite_state(d / "iter000001", to_v1)
    (tmp_path / "run" / "metrics.jsonl").write_text(
        (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    resumed = ds.make_trainer(model_path, tmp_path / "run", "run.checkpoint_every=1")
    assert resumed.iteration == 1
    resumed.train()
    straight = ds.make_trainer(model_path, tmp_path / "straight", "run.checkpoint_every=1")
    straight.train()
    a, b = resumed.model.net.state_dict(), straight.model.net.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_unknown_state_version_is_one_line_naming_it(tmp_path, model_path, capsys):
    from flowcredit.cli.main import main

    d = _two_checkpoints(tmp_path, model_path, "run")
    _rewrite_state(d / "iter000002", lambda st: st.update(state_version=7))
    capsys.readouterr()
    assert main(["train", f"resume={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "iter000002: checkpoint state version 7; this flowcredit reads versions 1, 2 (version 2 is written)" in err
    assert sorted(p.name for p in d.iterdir()) == ["iter000001", "iter000002"]  # nothing deleted
