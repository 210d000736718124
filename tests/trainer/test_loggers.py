"""run.loggers: TensorBoard by default, Weights & Biases on request (wandb is not installed in the test environment,
so a fake `wandb` module with the same API surface — init/log/finish/util.generate_id — is injected into
sys.modules; with the real package the same code runs offline under WANDB_MODE=offline)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_script as ds

from flowcredit.trainer.loggers import TensorBoardLogger, WandbLogger, build_loggers, scalars_of


class FakeRun:
    def __init__(self, **kw):
        self.init_kw, self.logged, self.finished = kw, [], False

    def log(self, data, step=None):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished = True


@pytest.fixture()
def fake_wandb(monkeypatch):
    runs: list[FakeRun] = []
    mod = types.ModuleType("wandb")
    mod.init = lambda **kw: runs.append(FakeRun(**kw)) or runs[-1]
    mod.util = types.SimpleNamespace(generate_id=lambda: f"id{len(runs)}")
    monkeypatch.setitem(sys.modules, "wandb", mod)
    monkeypatch.setenv("WANDB_MODE", "offline")
    return runs


def test_scalars_of_keeps_finite_numbers_and_phase_seconds():
    rec = {"iteration": 3, "reward_mean": 0.5, "kl": float("nan"), "curve": [1.0, 2.0], "name": "x", "n": 4,
           "seconds": {"rollout": 1.5, "update": float("inf")}}
    assert scalars_of(rec) == {"reward_mean": 0.5, "n": 4.0, "seconds/rollout": 1.5}


def test_default_is_tensorboard(tmp_path):
    (lg,) = build_loggers(None, tmp_path)
    assert isinstance(lg, TensorBoardLogger)
    lg.log_scalars(1, {"a": 1.0})
    lg.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents*"))


def test_unknown_logger_is_one_line():
    with pytest.raises(ValueError, match="run.loggers: unknown logger 'mlflow'; choose from tensorboard, wandb"):
        build_loggers(["mlflow"], "x")


def test_missing_wandb_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb → ImportError
    with pytest.raises(ValueError, match="'wandb' is not installed; pip install wandb") as e:
        build_loggers(["wandb"], tmp_path)
    assert "\n" not in str(e.value)


def test_wandb_logger_logs_and_resumes_the_same_run(fake_wandb, tmp_path):
    (lg,) = build_loggers(["wandb"], tmp_path, {"run": {"seed": 1}})
    assert isinstance(lg, WandbLogger)
    lg.log_scalars(2, {"reward_mean": 0.25})
    lg.close()
    (run,) = fake_wandb
    assert run.init_kw["project"] == "flowcredit" and run.init_kw["name"] == tmp_path.name
    assert run.init_kw["dir"] == str(tmp_path) and run.init_kw["config"] == {"run": {"seed": 1}}
    assert run.init_kw["resume"] == "allow" and run.logged == [(2, {"reward_mean": 0.25})] and run.finished
    build_loggers(["wandb"], tmp_path)[0].close()  # a resumed run continues the same W&B run
    assert fake_wandb[1].init_kw["id"] == run.init_kw["id"] == (tmp_path / "wandb_id.txt").read_text().strip()


def test_trainer_logs_to_tensorboard_and_wandb(fake_wandb, tmp_path, model_path):
    tr = ds.make_trainer(model_path, tmp_path / "run", "run.loggers=[tensorboard, wandb]", "run.eval_every=2")
    tr.train()
    (run,) = fake_wandb
    assert run.finished and run.init_kw["config"]["run"]["loggers"] == ["tensorboard", "wandb"]
    train_steps = [step for step, data in run.logged if "reward_mean" in data]
    assert train_steps == [1, 2]
    assert all("seconds/rollout" in d and "grad_norm" in d for _, d in run.logged if "reward_mean" in d)
    assert [step for step, data in run.logged if "eval/reward" in data] == [0, 2]  # initial model + iteration 2
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents*"))


def test_trainer_with_wandb_missing_is_one_line(monkeypatch, tmp_path, model_path):
    from flowcredit.trainer.faults import TrainingError

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(TrainingError, match="pip install wandb"):
        ds.make_trainer(model_path, tmp_path / "run", "run.loggers=[wandb]")
