"""FSDP (``dist.fsdp``) for full fine-tunes: 2 CPU processes (gloo, torchrun) with the network sharded by FSDP2 train
like 1 unsharded process; the checkpoint holds the gathered full weights in the plain layout and resumes, sharded
or not; the config rejects FSDP with LoRA; one process ignores the switch with a warning."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_script as ds  # noqa: E402

from flowcredit.cli.main import PRESET_DIR  # noqa: E402
from flowcredit.config import load_config  # noqa: E402
from flowcredit.config.load import ConfigError  # noqa: E402
from flowcredit.config.schema import TrainConfig  # noqa: E402
from flowcredit import checkpoints as checkpoint  # noqa: E402

# stepwise: step rewards, KL to the (sharded) reference moving as an EMA of the policy, sharded EMA; 3 optimizer steps per iteration with
# 1-pair micro-batches, so the ranks' micro-batch counts differ and the zero-weight padding passes run; gradient
# clipping active (the norms are ~1e-2); gradient checkpointing inside the sharded blocks; a periodic evaluation and
# the gold guard every iteration and the final evaluation (with the baseline) on every rank.
EXTRA = (
    "method=stepwise", "estimate.substeps=2", "optim.kl_beta=0.1", "optim.kl_reference=ema", "optim.ema_decay=0.5",
    "optim.updates_per_epoch=3", "optim.micro_batch=1", "optim.grad_clip=0.005", "model.gradient_checkpointing=true",
    "run.checkpoint_every=1",
    "run.eval_every=1", "run.eval_at_end=true", "run.gold_reward=dist_script:ImageMeanReward", "run.gold_every=1",
    "run.gold_limit=4",
)


# Seen once in a full suite on a loaded 2-core machine (not in 6 reruns alone): after both ranks had finished training,
# one rank died with SIGABRT and this line from a gloo worker thread at process teardown (the class of crash of
# pytorch/pytorch#190489). It is not the code under test; such a run is repeated once from scratch.
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun(model_path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(ds.__file__)), str(model_path), str(out), *extra]
    for attempt in range(2):
        proc = subprocess.run(cmd, env=ds.child_env(), capture_output=True, text=True, timeout=120)
        if proc.returncode == 0 or GLOO_TEARDOWN_ABORT not in proc.stderr or attempt:
            break
        shutil.rmtree(out, ignore_errors=True)  # a clean rerun, not a resume of the aborted one
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fsdp_two_processes_match_one_process_and_resume(tmp_path, model_path):
    prompts = tmp_path / "eval_prompts.txt"  # a small final evaluation
    prompts.write_text("a red circle\na blue square\ntwo green triangles\na yellow circle\n")
    EXTRA = (*globals()["EXTRA"], f"run.eval_prompts={prompts}")
    one = ds.make_trainer(model_path, tmp_path / "one", *EXTRA)  # 2 iterations
    one.train()
    ref2 = {k: v.detach().clone() for k, v in one.model.net.state_dict().items()}
    m1, e1 = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "one" / "eval_curve.jsonl")
    g1, v1 = read_jsonl(tmp_path / "one" / "gold.jsonl"), json.loads((tmp_path / "one" / "eval.json").read_text())
    NO_END_EVAL = ("run.iterations=3", "run.eval_at_end=false")  # resumed runs: a 3rd iteration, no final evaluation
    three = ds.make_trainer(model_path, tmp_path / "one", *EXTRA, *NO_END_EVAL)  # resumes
    three.train()
    ref3 = three.model.net.state_dict()

    t0 = time.time()
    torchrun(model_path, tmp_path / "two", *EXTRA, "dist.fsdp=true")
    seconds = time.time() - t0
    r0 = torch.load(tmp_path / "two" / "final_rank0.pt")
    r1 = torch.load(tmp_path / "two" / "final_rank1.pt")
    # really sharded: every rank stored about half of every weight matrix
    s0, s1 = torch.load(tmp_path / "two" / "shards_rank0.pt"), torch.load(tmp_path / "two" / "shards_rank1.pt")
    for k, v in r0.items():
        assert s0[k] + s1[k] == v.numel() and (v.shape[0] < 2 or max(s0[k], s1[k]) < v.numel()), k
    assert r0.keys() == ref2.keys()
    worst = 0.0
    for k in ref2:
        assert torch.equal(r0[k], r1[k]), f"ranks disagree on {k}"
        torch.testing.assert_close(r0[k], ref2[k], rtol=1e-5, atol=1e-5, msg=f"FSDP 2 processes vs 1: {k}")
        worst = max(worst, float((r0[k] - ref2[k]).abs().max()))
    print(f"FSDP vs 1 process after 2 iterations: max |Δθ| = {worst:.2e}; 2-process run {seconds:.1f} s")
    m2 = read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert [r["iteration"] for r in m2] == [1, 2]
    for a, b in zip(m1, m2):
        assert a["pairs_trained"] == b["pairs_trained"] and a["nfe_update"] == b["nfe_update"]
        for k in ("reward_mean", "grad_norm", "loss", "kl"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), k
    e2 = read_jsonl(tmp_path / "two" / "eval_curve.jsonl")
    assert [r["iteration"] for r in e2] == [0, 1, 2]  # written once, by rank 0
    for a, b in zip(e1, e2):
        assert b["eval_reward"] == pytest.approx(a["eval_reward"], rel=1e-5), "evaluation with the sharded EMA"
    g2 = read_jsonl(tmp_path / "two" / "gold.jsonl")
    assert [r["gold"] for r in g2] == pytest.approx([r["gold"] for r in g1], rel=1e-5)
    v2 = json.loads((tmp_path / "two" / "eval.json").read_text())
    for which in ("trained", "base"):
        assert v2[which]["reward_mean"] == pytest.approx(v1[which]["reward_mean"], rel=1e-5), which

    # the checkpoint holds the gathered full weights, EMA and AdamW state in the plain (unsharded) layout
    st = checkpoint.load(tmp_path / "two" / "checkpoints" / "iter000002")
    assert st["model"].keys() == r0.keys() and all(torch.equal(st["model"][k], r0[k]) for k in r0)
    assert st["ema"].keys() == set(one.trainable_names)
    assert sorted(st["optimizer"]["state"]) == list(range(len(one.trainable_names)))
    plain = checkpoint.load(tmp_path / "one" / "checkpoints" / "iter000002")  # the 1-process one
    assert st["optimizer"]["param_groups"] == plain["optimizer"]["param_groups"]
    for i, s in st["optimizer"]["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert type(s[key]) is torch.Tensor, "full tensors, not DTensor shards"
            torch.testing.assert_close(s[key], plain["optimizer"]["state"][i][key], rtol=1e-4, atol=1e-7)
    for k, v in st["ema"].items():
        torch.testing.assert_close(v, plain["ema"][k], rtol=1e-5, atol=1e-5)
    assert st["kl_reference"].keys() == set(one.trainable_names)  # the moving KL reference, gathered
    for k, v in st["kl_reference"].items():
        assert type(v) is torch.Tensor
        torch.testing.assert_close(v, plain["kl_reference"][k], rtol=1e-5, atol=1e-5)

    # resume under FSDP for a third iteration; and resume the same checkpoint in ONE unsharded process
    torchrun(model_path, tmp_path / "two", *EXTRA, "dist.fsdp=true", *NO_END_EVAL)
    f0, f1 = torch.load(tmp_path / "two" / "final_rank0.pt"), torch.load(tmp_path / "two" / "final_rank1.pt")
    for k in ref3:
        assert torch.equal(f0[k], f1[k])
        torch.testing.assert_close(f0[k], ref3[k], rtol=1e-5, atol=1e-5, msg=f"FSDP resume vs 1 process: {k}")
    assert [r["iteration"] for r in read_jsonl(tmp_path / "two" / "metrics.jsonl")] == [1, 2, 3]

    (tmp_path / "plain" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "two" / "checkpoints" / "iter000002", tmp_path / "plain" / "checkpoints" / "iter000002")
    back = ds.make_trainer(model_path, tmp_path / "plain", *EXTRA, *NO_END_EVAL)
    assert back.iteration == 2
    back.train()
    for k, v in back.model.net.state_dict().items():
        torch.testing.assert_close(v, ref3[k], rtol=1e-5, atol=1e-5, msg=f"FSDP checkpoint resumed unsharded: {k}")


def _config(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, "tiny_flow_grpo", list(overrides), preset_dirs=[PRESET_DIR])


def test_config_rejects_fsdp_with_lora_and_offloaded_optimizer():
    with pytest.raises(ConfigError, match=r"dist.fsdp=true does not support model.trainable=lora.*dist.fsdp=false"):
        _config("model.name=sd3", "model.trainable=lora", "dist.fsdp=true")
    with pytest.raises(ConfigError, match=r"dist.fsdp=true already shards.*optim.offload_optimizer=false"):
        _config("dist.fsdp=true", "optim.offload_optimizer=true")
    assert _config("dist.fsdp=true").dist.fsdp and not _config().dist.fsdp


def test_fsdp_with_one_process_warns_and_trains_unsharded(tmp_path, model_path):
    with pytest.warns(UserWarning, match="dist.fsdp=true with one process"):
        tr = ds.make_trainer(model_path, tmp_path / "one", "dist.fsdp=true", "run.iterations=1")
    assert not tr.dist.fsdp and not any(hasattr(p, "placements") for p in tr.trainable)
    tr.train()
