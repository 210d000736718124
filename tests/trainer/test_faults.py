"""Bad events a run survives (NaN/Inf rewards or gradients, a reward that fails then recovers, SIGTERM) and the ones
that stop it with a clear error and an intact last checkpoint (NaN every iteration, a reward that keeps failing)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_script as ds  # noqa: E402

from flowcredit.rewards.base import RewardOutput  # noqa: E402
from flowcredit import checkpoints as checkpoint  # noqa: E402
from flowcredit.trainer.faults import RetryingCall, RewardInputRejected, RunStopped, is_input_error  # noqa: E402


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(tr):
    return {k: v.detach().clone() for k, v in tr.model.net.state_dict().items()}


class Scripted:
    """image_mean_reward, with a per-call script: 'ok', 'nan' (one NaN score), 'raise' (a fault), 'bad' (an input
    error: ValueError), or a sleep in seconds."""

    def __init__(self, script):
        self.script, self.calls = list(script), 0

    def __call__(self, images, prompts, metadata, **kw):
        action = self.script[self.calls] if self.calls < len(self.script) else "ok"
        self.calls += 1
        out = ds.image_mean_reward(images, prompts, metadata)
        if action == "nan":
            out.scores[0] = float("nan")
        elif action == "raise":
            raise ConnectionError("reward server unreachable")
        elif action == "bad":
            raise ValueError("shapes world resolution 20 is not supported;\nuse one of [32, 64]")
        elif isinstance(action, float):
            time.sleep(action)
        return out


# ---------------------------------------------------------------------------------------------------------------
# NaN / Inf
# ---------------------------------------------------------------------------------------------------------------


def test_nan_rewards_skip_the_update_and_are_counted(tmp_path, model_path, capsys):
    tr = ds.make_trainer(model_path, tmp_path / "run", "run.iterations=3", reward=Scripted(["ok", "nan", "ok"]))
    snaps = []
    orig = tr.train_step

    def step():
        stats = orig()
        snaps.append(weights(tr))
        return stats

    tr.train_step = step
    assert tr.train()["iterations"] == 3
    recs = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in recs] == [1, 2, 3]
    assert recs[1]["skipped_update"] == 1 and recs[1]["nonfinite_skipped"] == 1 and recs[1]["nonfinite_reason"] == "rewards"
    assert recs[1]["pairs_trained"] == 0 and "nonfinite_skipped" not in recs[0] and recs[2]["grad_norm"] > 0
    assert all(torch.equal(snaps[0][k], snaps[1][k]) for k in snaps[0])  # iteration 2 changed nothing
    assert not all(torch.equal(snaps[1][k], snaps[2][k]) for k in snaps[1])  # iteration 3 trained again
    assert "ALARM: non-finite rewards at iteration 2: update skipped (1 of 3 in a row, 1 in total)" in capsys.readouterr().err


def test_nonfinite_gradients_skip_the_optimizer_step(tmp_path, model_path, capsys):
    tr = ds.make_trainer(model_path, tmp_path / "run", "run.iterations=2")
    p = tr.trainable[0]
    p.register_hook(lambda g: g * float("inf") if tr.iteration == 0 else g)
    before = weights(tr)
    tr.train_step().metrics()
    assert all(torch.equal(before[k], v) for k, v in weights(tr).items())
    tr.iteration += 1
    stats = tr.train_step().metrics()
    assert stats.get("skipped_update", 0) == 0 and tr.nonfinite.consecutive == 0 and tr.nonfinite.total == 1
    assert "non-finite gradients at iteration 1" in capsys.readouterr().err


def test_repeated_nan_stops_the_run_with_the_last_checkpoint_intact(tmp_path, model_path, capsys):
    from flowcredit.cli.main import main

    out = tmp_path / "run"
    base = ds.overrides(model_path, out, "run.iterations=6", "run.checkpoint_every=1", "faults.max_nonfinite=2")
    # a clean first iteration, then a reward that always returns NaN
    tr = ds.make_trainer(model_path, out, "run.iterations=6", "run.checkpoint_every=1", "faults.max_nonfinite=2",
                         reward=Scripted(["ok"] + ["nan"] * 10))
    with pytest.raises(RunStopped, match="at iteration 3: 2 consecutive updates skipped for NaN/Inf .*faults.max_nonfinite reached"):
        tr.train()
    d = out / "checkpoints"
    # iteration 2 was skipped (and checkpointed: counting and skipping is survivable); iteration 3 hit the limit
    assert checkpoint.find_latest(d) == d / "iter000002" and checkpoint.verify(d / "iter000002") is None
    assert [r["iteration"] for r in read_metrics(out)] == [1, 2]
    ck = checkpoint.load(d / "iter000002")
    assert ck["faults"] == {"consecutive": 1, "total": 1}

    # through the CLI: one line, exit code 3
    capsys.readouterr()
    base = [o for o in base if not o.startswith("run.out_dir")] + [f"run.out_dir={tmp_path / 'cli'}"]
    assert main(["train", "tiny_flow_grpo", *base, "reward.name=dist_script:NaNReward"]) == 3
    assert "error: stopped at iteration 3: 2 consecutive updates skipped for NaN/Inf (last: rewards)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Rewards that fail
# ---------------------------------------------------------------------------------------------------------------


def test_reward_failing_twice_then_succeeding_is_survived(tmp_path, model_path, capsys):
    flaky = ds.make_trainer(model_path, tmp_path / "flaky", "faults.reward_backoff=0.01", reward=Scripted(["raise", "raise"]))
    flaky.train()
    err = capsys.readouterr().err
    assert err.count("warning: reward failed") == 2
    assert "attempt 1 of 3: ConnectionError: reward server unreachable); retrying in 0.01 s" in err
    assert "attempt 2 of 3" in err and flaky.call_reward.total_retries == 2
    clean = ds.make_trainer(model_path, tmp_path / "clean")
    clean.train()
    a, b = weights(flaky), weights(clean)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the retries changed nothing


def test_reward_timeout_is_retried(tmp_path, model_path, capsys):
    tr = ds.make_trainer(model_path, tmp_path / "run", "run.iterations=1", "faults.reward_timeout=0.2", "faults.reward_backoff=0",
                         reward=Scripted([0.6]))
    tr.train()
    assert "TimeoutError: no answer within faults.reward_timeout=0.2 s" in capsys.readouterr().err


def test_reward_that_keeps_failing_stops_with_the_last_checkpoint_intact(tmp_path, model_path):
    out = tmp_path / "run"
    tr = ds.make_trainer(model_path, out, "run.iterations=3", "run.checkpoint_every=1", "faults.reward_retries=1",
                         "faults.reward_backoff=0", reward=Scripted(["ok"] + ["raise"] * 10))
    with pytest.raises(RunStopped, match=r"reward failed 2 times \(faults.reward_retries=1\); last error: ConnectionError"):
        tr.train()
    d = out / "checkpoints"
    assert sorted(p.name for p in d.iterdir()) == ["iter000001"]
    assert checkpoint.verify(d / "iter000001") is None
    assert [r["iteration"] for r in read_metrics(out)] == [1]


def test_retry_backoff_doubles():
    sleeps = []
    call = RetryingCall(retries=3, backoff=0.5, timeout=0, sleep=sleeps.append)
    fn = Scripted(["raise", "raise", "raise"])
    out = call(fn, torch.zeros(1, 3, 2, 2), ["p"], [{}])
    assert isinstance(out, RewardOutput) and sleeps == [0.5, 1.0, 2.0]


# ---------------------------------------------------------------------------------------------------------------
# Input errors: not retried (a ValueError from the reward, a 4xx from the reward service); faults still are
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [0, 5.0])  # inline, and in the worker thread of faults.reward_timeout
def test_input_error_is_not_retried(timeout):
    sleeps = []
    call = RetryingCall(retries=3, backoff=0.5, timeout=timeout, sleep=sleeps.append)
    fn = Scripted(["bad", "ok"])
    with pytest.raises(RewardInputRejected) as ei:
        call(fn, torch.zeros(1, 3, 2, 2), ["p"], [{}])
    e = ei.value
    assert fn.calls == 1 and sleeps == [] and call.total_retries == 0
    assert isinstance(e, RunStopped) and isinstance(e, ValueError) and isinstance(e.__cause__, ValueError)
    assert str(e) == (
        "reward rejected its input, not retried (the same input fails the same way): ValueError: shapes world "
        "resolution 20 is not supported; use one of [32, 64]. The last checkpoint is intact; fix the input (image "
        "size, prompts, metadata) or the reward's options and resume"
    )


def test_is_input_error_by_type_and_status():
    from flowcredit.rewards.remote import RemoteRewardError, RewardInputError
    from flowcredit.rewards.wire import WireError

    assert is_input_error(ValueError("bad")) and is_input_error(RewardInputError("http://h:1", 422, "bad"))
    assert is_input_error(RemoteRewardError("refused", 401))
    for fault in (ConnectionError("refused"), TimeoutError("timed out"), RuntimeError("CUDA out of memory"),
                  RemoteRewardError("no reward server could score ...")):
        assert not is_input_error(fault), fault
    for status in (408, 429, 500, 502, 503):  # the service's state, not the input: retried
        assert not is_input_error(WireError(status, "x")) and not is_input_error(RemoteRewardError("x", status))


class _Picky:
    """A reward for images of 512 px only (the trainer's tiny model renders 32 px): ValueError for the rest."""

    name = "picky"

    def __call__(self, images, prompts, metadata, **kw):
        raise ValueError(f"resolution {images.shape[-1]} is not supported; use one of [512]")


class _OOM:
    name = "oom"

    def __call__(self, images, prompts, metadata, **kw):
        raise RuntimeError("CUDA out of memory")


def test_reward_service_input_error_is_not_retried_but_faults_are():
    """RetryingCall over RemoteReward: a 422 reaches the server once (counted server side); a 500 and a refused
    connection are retried faults.reward_retries times."""
    from flowcredit.rewards.remote import RemoteReward, RewardInputError
    from flowcredit.rewards.server import RewardServer

    x = torch.rand(2, 3, 8, 8)
    picky, oom = RewardServer(_Picky()).start(), RewardServer(_OOM()).start()
    try:
        call = RetryingCall(retries=2, backoff=0.01, timeout=10.0)
        t0 = time.monotonic()
        with pytest.raises(RewardInputRejected) as ei:
            call(RemoteReward(urls=picky.url, max_retries=2, backoff=5.0), x, ["a", "b"], [{}, {}])
        assert time.monotonic() - t0 < 2.5  # no client backoff (5 s), no trainer retry
        assert picky.requests == 1 and call.total_retries == 0 and isinstance(ei.value.__cause__, RewardInputError)
        assert (f"RewardInputError: reward service {picky.url} refused the request: HTTP 422: reward 'picky' cannot "
                "score this input: resolution 8 is not supported; use one of [512]") in str(ei.value)

        with pytest.raises(RunStopped, match=r"reward failed 3 times .*HTTP 500: reward 'oom' failed: Runtime") as ei:
            call(RemoteReward(urls=oom.url, max_retries=0), x, ["a", "b"], [{}, {}])
        assert not isinstance(ei.value, RewardInputRejected) and oom.requests == 3 and call.total_retries == 2

        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # closed again: connection refused
        attempts = []
        down = RemoteReward(urls=f"http://127.0.0.1:{port}", max_retries=0, backoff=0)

        def counted(*a, **k):
            attempts.append(1)
            return down(*a, **k)

        with pytest.raises(RunStopped, match="reward failed 3 times .*Connection refused"):
            call(counted, x, ["a", "b"], [{}, {}])
        assert len(attempts) == 3
    finally:
        picky.close()
        oom.close()


def test_reward_rejecting_its_input_stops_the_run_at_once_with_exit_3(tmp_path, model_path, capsys):
    """Through the CLI: one `error:` line naming the URL and the server's reason, exit 3 (the run had started), no
    retry warnings, one request at the server, nothing trained."""
    from flowcredit.cli.main import main
    from flowcredit.rewards.server import RewardServer

    srv = RewardServer(_Picky()).start()
    try:
        out = tmp_path / "run"
        opts = f"{{urls: ['{srv.url}'], max_retries: 2, backoff: 5.0}}"
        args = ds.overrides(model_path, out, "reward.name=remote", f"reward.options={opts}", "faults.reward_retries=2",
                            "faults.reward_backoff=5.0")
        t0 = time.monotonic()
        assert main(["train", "tiny_flow_grpo", *args]) == 3
        elapsed = time.monotonic() - t0
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert len(lines) == 1 and "Traceback" not in err and "warning: reward failed" not in err, err
        assert lines[0].startswith(
            "error: reward rejected its input, not retried (the same input fails the same way): RewardInputError: "
            f"reward service {srv.url} refused the request: HTTP 422: reward 'picky' cannot score this input: "
            "resolution 32 is not supported; use one of [512]. The last checkpoint is intact"
        ), lines[0]
        assert srv.requests == 1 and elapsed < 60
        assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()
    finally:
        srv.close()


# ---------------------------------------------------------------------------------------------------------------
# SIGTERM / SIGINT
# ---------------------------------------------------------------------------------------------------------------


def test_sigterm_checkpoints_at_the_end_of_the_iteration_and_exits_0(tmp_path, model_path, capsys):
    import signal

    from flowcredit.cli.main import main

    handler = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "run"
    args = ds.overrides(model_path, out, "run.iterations=5", "run.checkpoint_every=10", "reward.name=dist_script:SigtermAtIteration2Reward")
    assert main(["train", "tiny_flow_grpo", *args]) == 0
    assert signal.getsignal(signal.SIGTERM) is handler  # handlers restored
    captured = capsys.readouterr()
    assert "received SIGTERM: finishing this iteration" in captured.err
    assert f"stopped by SIGTERM after iteration 2; checkpoint written. Continue with: flowcredit train resume={out}" in captured.out
    d = out / "checkpoints"
    assert checkpoint.find_latest(d) == d / "iter000002"  # iteration 2 finished, checkpoint_every not reached
    assert [r["iteration"] for r in read_metrics(out)] == [1, 2]
    assert not (out / "eval.json").exists()

    ds.SigtermAtIteration2Reward.calls = 10  # no further signal
    assert main(["train", f"resume={out}"]) == 0
    assert [r["iteration"] for r in read_metrics(out)] == [1, 2, 3, 4, 5]


def test_nan_on_one_rank_is_skipped_and_stopped_by_every_rank(tmp_path, model_path):
    """2 processes, NaN rewards on rank 1 only: the gathered rewards make every rank skip (and then stop) at the same
    iteration; the run exits non-zero with the one-line error and rank 0's last checkpoint verifies."""
    import subprocess

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(Path(ds.__file__)),
           str(model_path), str(out), "run.iterations=3", "run.checkpoint_every=1", "faults.max_nonfinite=2",
           "reward.name=dist_script:NaNOnRank1Reward"]
    proc = subprocess.run(cmd, env=ds.child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert "ALARM: non-finite rewards at iteration 1: update skipped (1 of 2 in a row, 1 in total)" in log  # rank 0's view
    assert "error: stopped at iteration 2: 2 consecutive updates skipped for NaN/Inf (last: rewards)" in log
    d = out / "checkpoints"
    assert checkpoint.find_latest(d) == d / "iter000001" and not (d / "iter000002").exists()
    assert [(r["iteration"], r["nonfinite_reason"]) for r in read_metrics(out)] == [(1, "rewards")]
    init = ds.make_trainer(model_path, tmp_path / "init")  # the skipped iteration left the weights as initialised
    a, b = weights(init), checkpoint.load(d / "iter000001")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
