"""README "Extending flowcredit": a credit method and an objective, each with its own options dataclass, defined and
registered in THIS file alone train 2 iterations through the real trainer (no other file is touched)."""

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import flowcredit

from flowcredit.credit.base import CreditCfg, CreditInput, CreditOutput
from flowcredit.credit.registry import register_credit
from flowcredit.objectives import LossContext, LossOut, register_objective
from flowcredit.objectives.base import first_steps
from flowcredit.samplers.policy import policy_velocity
from flowcredit.config import ConfigError, load_config
from flowcredit.config.schema import TrainConfig
from flowcredit.rewards.base import RewardOutput
from flowcredit.trainer.loop import Trainer
from flowcredit.types import cond_index

CALLS = {"credit": 0, "loss": 0}


@dataclass
class LaterStepsOptions:
    """The toy credit method's own options: credit.options.power."""

    power: float = field(default=1.0, metadata={"help": "Step weight ((j + 1) / T) ** power.", "ge": 0})


def later_steps_count_more(inp: CreditInput, opts: LaterStepsOptions, cfg: CreditCfg) -> CreditOutput:
    """Toy credit: the group-centred reward, weighted by ((j + 1) / T) ** power over the steps. Returns (B, T)."""
    CALLS["credit"] += 1
    CALLS["power"] = opts.power
    r = inp.rewards.float()
    centred = torch.empty_like(r)
    for g in inp.group_ids.unique():
        m = inp.group_ids == g
        centred[m] = r[m] - r[m].mean()
    w = (torch.arange(1, inp.num_steps + 1, dtype=torch.float32) / inp.num_steps) ** opts.power
    return CreditOutput(advantages=centred[:, None] * w[None, :], stats={"toy_weight_mean": float(w.mean())}, state={})


@dataclass
class ToyObjectiveOptions:
    scale: float = 1.0


class RewardWeightedRegression:
    """Toy objective: −A·(−‖v_θ(x_t) − (x^(j+1) − x^(j))/(t_{j+1} − t_j)‖²), i.e. regress the velocity onto the
    rollout's own finite difference, weighted by the advantage (works with any rollout, ODE included)."""

    needs_log_probs = False
    sum_keys = ("toy_mse",)
    max_keys = ()

    def __init__(self, options):
        self.scale = options.scale

    def skip_zero_advantage(self, on_policy, kl_beta):
        return True

    def trained_steps(self, traj, timestep_fraction):
        return first_steps(traj.num_steps, timestep_fraction)

    def prepare(self, ctx: LossContext, pairs):
        return 0

    def loss(self, ctx: LossContext, bi, ji, adv):
        CALLS["loss"] += 1
        traj = ctx.traj
        x_t, x_next = traj.latents[bi, ji], traj.latents[bi, ji + 1]
        t, t_next = traj.timesteps[ji], traj.timesteps[ji + 1]
        u = cond_index(ctx.uncond, bi) if ctx.uncond is not None else None
        v = policy_velocity(ctx.model, x_t, t, cond_index(ctx.cond, bi), u, ctx.guidance)
        target = (x_next - x_t) / (t_next - t).view(-1, *([1] * (x_t.dim() - 1)))
        mse = (v.float() - target.float()).pow(2).flatten(1).mean(1)
        return LossOut(loss=self.scale * adv.float() * mse, sums={"toy_mse": float(mse.detach().sum())})


def image_mean_reward(images, prompts, metadata, **kw):
    """A deterministic fake reward with distinct scores per sample (so group advantages are non-zero)."""
    return RewardOutput(scores=images.float().mean(dim=(1, 2, 3)))


register_credit("toy_later_steps", later_steps_count_more, LaterStepsOptions)
register_objective("toy_rwr", lambda opts, cfg: RewardWeightedRegression(opts), ToyObjectiveOptions, "toy")


def test_toy_credit_and_toy_objective_train_two_iterations(tmp_path, model_path):  # model_path: conftest.py
    presets = Path(flowcredit.__file__).parent / "configs"
    cfg = load_config(TrainConfig, "tiny_flow_grpo", [
        f"model.path={model_path}", "model.precision=fp32", "sampler.num_steps=3", "data.prompts_per_iter=2",
        "data.group_size=2", "run.threads=1", f"run.out_dir={tmp_path / 'run'}", "run.eval_at_end=false",
        "run.grid_every=0", "method=custom", "credit.name=toy_later_steps", "credit.options={power: 2.0}",
        "objective.name=toy_rwr",
        "objective.options={scale: 2.0}", "sampler.name=ode", "run.iterations=2", "sampler.train_steps_per_sample=0",
    ], preset_dirs=[presets])
    tr = Trainer(cfg, preset_name="test")
    tr.setup()
    tr.reward_fn = image_mean_reward
    before = [p.detach().clone() for p in tr.trainable]
    tr.train()
    assert CALLS["credit"] == 2 and CALLS["loss"] >= 2 and CALLS["power"] == 2.0
    assert tr.objective.scale == 2.0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    rec = json.loads(lines[-1])
    assert rec["credit/toy_weight_mean"] > 0 and rec["toy_mse"] > 0 and rec["pairs_trained"] > 0
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, tr.trainable))


def test_toy_options_are_checked_like_every_other_key():
    presets = Path(flowcredit.__file__).parent / "configs"
    base = ["method=custom", "credit.name=toy_later_steps"]
    with pytest.raises(ConfigError, match=r"unknown key 'credit.options.pwr' at override .*did you mean 'power'"):
        load_config(TrainConfig, "tiny_flow_grpo", [*base, "credit.options.pwr=2"], preset_dirs=[presets])
    with pytest.raises(ConfigError, match=r"credit.options.power = -1.0 \(override .*\) must be >= 0"):
        load_config(TrainConfig, "tiny_flow_grpo", [*base, "credit.options.power=-1"], preset_dirs=[presets])
    with pytest.raises(ConfigError, match=r"unknown key 'objective.options.scal' .*did you mean 'scale'"):
        load_config(TrainConfig, "tiny_flow_grpo", [*base, "objective.name=toy_rwr", "objective.options.scal=2"],
                    preset_dirs=[presets])
