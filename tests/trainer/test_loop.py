"""Trainer end to end on a small random tiny model (CPU, fp32): on-policy log-prob parity, every trainable
parameter updated, micro-batch invariance of the gradient, zero-variance groups, run folder, methods, resume."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowcredit.cli.main import PRESET_DIR
from flowcredit.config import load_config
from flowcredit.config.schema import TrainConfig
from flowcredit.models.tiny import TinyDiTConfig, TinyFlowModel
from flowcredit.rewards.base import RewardOutput
from flowcredit.samplers.policy import policy_velocity
from flowcredit.samplers.sde import sampler_step
from flowcredit import checkpoints as checkpoint
from flowcredit.trainer.loop import Trainer

P, G, T = 2, 2, 3  # prompts per iteration, group size, rollout steps
B = P * G
T_TRAINED = int(T * 0.99)  # the preset's timestep_fraction 0.99 trains the first 2 of 3 steps


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A random width-32 tiny model; the zero-initialised adaLN / output layers are perturbed so that every
    parameter influences the velocity (with the zero init only the output layer would get a gradient)."""
    torch.manual_seed(0)
    model = TinyFlowModel(TinyDiTConfig(width=32, depth=1, heads=2))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.net.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.save(tmp_path_factory.mktemp("model"), name="m")


def make_cfg(tmp_path, model_path, *overrides, out="run"):
    base = [
        f"model.path={model_path}", "model.precision=fp32", f"sampler.num_steps={T}",
        f"data.prompts_per_iter={P}", f"data.group_size={G}", "run.iterations=1", "run.threads=1",
        f"run.out_dir={tmp_path / out}", "run.eval_prompts=shapes:test_unique", "run.eval_steps=2",
        "run.eval_at_end=false", "run.grid_every=0",
    ]
    return load_config(TrainConfig, "tiny_flow_grpo", base + list(overrides), preset_dirs=[PRESET_DIR])


def make_trainer(tmp_path, model_path, *overrides, out="run", reward=None):
    tr = Trainer(make_cfg(tmp_path, model_path, *overrides, out=out), preset_name="test")
    tr.setup()
    if reward is not None:
        tr.reward_fn = reward
    return tr


def image_mean_reward(images, prompts, metadata, **kw):
    """A deterministic fake reward with distinct scores per sample (so group advantages are non-zero)."""
    return RewardOutput(scores=images.float().mean(dim=(1, 2, 3)))


def constant_reward(images, prompts, metadata, **kw):
    return RewardOutput(scores=torch.full((images.shape[0],), 0.5))


class ShapesPlusMean:
    """The real shapes reward (strict/correct components) plus a small image-mean term so groups have variance."""

    def __init__(self, real):
        self.real = real

    def __call__(self, images, prompts, metadata, **kw):
        out = self.real(images, prompts, metadata)
        out.scores = out.scores + 0.01 * images.float().mean(dim=(1, 2, 3))
        return out


def spy_update(tr):
    """Wrap tr.plan_update to record the update's inputs (and run a check before the optimizer touches the
    weights)."""
    seen: dict = {}
    orig = tr.plan_update

    def wrapped(ro, credit):
        traj, adv = ro.traj, credit.advantages
        seen.update(traj=traj, adv=adv.clone(), cond=ro.cond, uncond=ro.uncond)
        if "before" in seen:
            seen["before"](traj, adv, ro.cond, ro.uncond)
        return orig(ro, credit)

    tr.plan_update = wrapped
    return seen


def over_budget(tr, iter_seconds: list[float], fwd_rates: list[float]) -> bool:
    """run.budget_minutes with the given measurements (`harness.TimeBudget.over`)."""
    tr.budget.iter_seconds, tr.budget.fwd_rates = list(iter_seconds), list(fwd_rates)
    return tr.budget.over()


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def all_finite(value) -> bool:
    if isinstance(value, dict):
        return all(all_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(all_finite(v) for v in value)
    if isinstance(value, (int, float)):
        return math.isfinite(value)
    return True


# ---------------------------------------------------------------------------------------------------------------
# On-policy parity
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("guidance", [1.0, 3.0])
@pytest.mark.parametrize("sampler", ["flow_sde", "ddim_sde", "cps"])
def test_on_policy_logprob_parity(tmp_path, model_path, sampler, guidance):
    tr = make_trainer(tmp_path, model_path, f"sampler.name={sampler}", f"sampler.guidance_scale={guidance}", reward=image_mean_reward)
    seen = spy_update(tr)
    recomputed = {}

    def recompute(traj, adv, cond, uncond):
        # Independently of the trainer's metric: recompute every trained step's log-prob with the current (= rollout)
        # weights, in train mode like the update, through the same policy/step functions.
        tr.model.train()
        with torch.no_grad():
            for j in torch.nonzero(traj.step_mask).flatten().tolist():
                t, tn = traj.timesteps[j].expand(B), traj.timesteps[j + 1].expand(B)
                v = policy_velocity(tr.model, traj.latents[:, j], t, cond, uncond, guidance)
                step = sampler_step(tr.params, traj.latents[:, j], v, t, tn, x_next=traj.latents[:, j + 1])
                recomputed[j] = step.log_prob

    seen["before"] = recompute
    stats = tr.train_step().metrics()
    traj = seen["traj"]
    assert traj.step_mask.tolist() == [True] * T_TRAINED + [False] * (T - T_TRAINED)
    assert stats["pairs_trained"] == B * T_TRAINED
    assert stats["nfe_rollout"] == B * T * (2 if guidance != 1.0 else 1)
    lp = traj.log_probs[:, traj.step_mask]
    assert torch.isfinite(lp).all() and lp.std() > 0  # real, sample-dependent log-probs
    assert stats["parity_max_abs_dlogp"] < 1e-5
    assert sorted(recomputed) == list(range(T_TRAINED))
    for j, rec in recomputed.items():
        assert (rec - traj.log_probs[:, j]).abs().max() < 1e-5, (sampler, guidance, j)
    assert stats["clipfrac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------------------
# The update touches every trainable parameter, and only those
# ---------------------------------------------------------------------------------------------------------------

FROZEN_BY_BLOCKS = ("text.", "patch_in.", "t_mlp.", "pool_mlp.")


def frozen_by(trainable: str, names) -> set[str]:
    """What model.trainable leaves frozen on the tiny model (independent of models/factory.py)."""
    if trainable == "blocks":
        return {n for n in names if n.startswith(FROZEN_BY_BLOCKS)}
    if trainable == "modulation":  # the conditioning path: t_mlp, pool_mlp, each block's adaLN, the output adaLN
        import re

        return {n for n in names if not re.match(r"(t_mlp|pool_mlp|ada_out|blocks\.\d+\.ada)\.", n)}
    return set()


@pytest.mark.parametrize("trainable", ["all", "blocks", "modulation"])
def test_one_step_changes_every_trainable_parameter(tmp_path, model_path, trainable):
    # lr = 1e-2 (≈300× the preset) on purpose: Adam's first step is lr·g/(|g| + eps); for a tensor whose gradient is
    # small next to eps = 1e-8 the step shrinks with it, and at a realistic lr a tensor that DID get a gradient could
    # move by less than an fp32 ulp and look untouched. weight_decay = 0 because AdamW's decay moves every non-zero
    # weight even without a gradient, which would make this test pass vacuously.
    tr = make_trainer(
        tmp_path, model_path, f"model.trainable={trainable}", "optim.lr=1e-2", "optim.weight_decay=0", reward=image_mean_reward
    )
    named = dict(tr.model.net.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    grads = {}
    orig_step = tr.opt.step

    def step_spy(*a, **k):
        grads.update({n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in named.items()})
        return orig_step(*a, **k)

    tr.opt.step = step_spy
    stats = tr.train_step().metrics()
    assert stats["pairs_trained"] > 0 and stats.get("skipped_update", 0) == 0 and stats["grad_norm"] > 0
    trainable_names = {n for n, p in named.items() if p.requires_grad}
    frozen = frozen_by(trainable, named)
    assert trainable_names == set(named) - frozen
    assert {id(p) for p in tr.trainable} == {id(named[n]) for n in trainable_names}
    unchanged = [n for n in trainable_names if torch.equal(named[n].detach(), before[n])]
    assert not unchanged, f"trainable parameters not updated: {unchanged}"
    no_grad = [n for n in trainable_names if grads[n] is None or not grads[n].abs().sum() > 0]
    assert not no_grad, f"trainable parameters without gradient: {no_grad}"
    for n in frozen:
        assert torch.equal(named[n].detach(), before[n]), n
        assert grads[n] is None, n
    if trainable != "all":
        assert len(frozen) > 0
    if trainable == "modulation":  # every block's adaLN and the output adaLN train; attention and MLPs do not
        assert {n for n in trainable_names if ".ada." in n} and not {n for n in trainable_names if ".qkv." in n}


# ---------------------------------------------------------------------------------------------------------------
# Micro-batching × accumulation does not change the gradient
# ---------------------------------------------------------------------------------------------------------------


def _grads_of_one_update(tmp_path, model_path, micro_batch):
    tr = make_trainer(
        tmp_path, model_path, "data.group_size=4", f"optim.micro_batch={micro_batch}", "optim.grad_clip=1e9",
        out=f"mb{micro_batch}", reward=image_mean_reward,
    )
    tr.opt.step = lambda *a, **k: None  # keep the accumulated gradient and the weights as they are
    stats = tr.train_step().metrics()
    return {n: p.grad.detach().clone() for n, p in tr.model.net.named_parameters()}, stats


def test_micro_batch_does_not_change_gradient(tmp_path, model_path):
    ref, ref_stats = _grads_of_one_update(tmp_path, model_path, 64)
    n_pairs = P * 4 * T_TRAINED
    assert ref_stats["pairs_trained"] == n_pairs
    assert sum(float(g.abs().sum()) for g in ref.values()) > 0
    for mb in (1, 5):  # 5 does not divide the 16 pairs: the last micro-batch is short
        grads, stats = _grads_of_one_update(tmp_path, model_path, mb)
        for n, g in ref.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=f"micro_batch={mb}: {n}")
        # the on-policy loss is Σ −A / N ≈ 0 (advantages are centred), so compare it absolutely
        assert stats["loss"] == pytest.approx(ref_stats["loss"], abs=1e-6)
        assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Zero-variance groups
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["flow_grpo", "stepwise"])
def test_zero_variance_groups_skip_update(tmp_path, model_path, method):
    tr = make_trainer(tmp_path, model_path, f"method={method}", "estimate.substeps=2", reward=constant_reward)
    seen = spy_update(tr)
    before = {n: p.detach().clone() for n, p in tr.model.net.state_dict().items()}
    result = tr.train()
    assert result["iterations"] == 1
    adv = seen["adv"]
    assert adv.shape == (B, T) and torch.isfinite(adv).all() and (adv == 0).all()
    after = tr.model.net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no optimizer step (not even weight decay)
    (rec,) = read_metrics(tmp_path / "run")
    assert rec["iteration"] == 1 and rec["skipped_update"] == 1 and rec["pairs_trained"] == 0
    assert rec["credit/zero_std_group_ratio"] == 1.0 and rec["reward_std"] == 0.0
    assert all_finite(rec), rec


def test_sampler_grid_model_needs_a_model_with_its_own_scheduler(tmp_path, model_path):
    from flowcredit.trainer.faults import TrainingError

    with pytest.raises(TrainingError, match="sampler.grid=model: model.name=tiny has no scheduler of its own"):
        make_trainer(tmp_path, model_path, "sampler.grid=model")
    assert not (tmp_path / "run").exists()  # refused before the run folder is written


def one_group_constant_reward(images, prompts, metadata, group_ids=None, **kw):
    """Group 0 scored by image mean (distinct rewards), group 1 all 0.5: its advantages are exactly 0."""
    scores = images.float().mean(dim=(1, 2, 3))
    return RewardOutput(scores=torch.where(group_ids == 0, scores, torch.full_like(scores, 0.5)))


def _grads_and_stats(tmp_path, model_path, out, *overrides, skip=True):
    tr = make_trainer(tmp_path, model_path, "optim.micro_batch=1", "optim.grad_clip=1e9", *overrides, out=out,
                      reward=one_group_constant_reward)
    if not skip:  # compute the zero-advantage pairs too
        tr.objective.skip_zero_advantage = lambda on_policy, kl_beta: False
    tr.opt.step = lambda *a, **k: None  # keep the accumulated gradient
    stats = tr.train_step().metrics()
    return {n: p.grad.detach().clone() for n, p in tr.model.net.named_parameters() if p.grad is not None}, stats


def test_batch_mean_over_planned_pairs_makes_the_skip_a_saving_of_compute_only(tmp_path, model_path):
    """optim.loss_mean=planned: 8 planned pairs (2 groups × 2 samples × 2 trained steps), 4 of them A = 0.
    Skipping those 4 gives the gradient of computing all 8 (their gradient is exactly 0), divided by 8 both times."""
    skipped, s1 = _grads_and_stats(tmp_path, model_path, "skip")
    computed, s2 = _grads_and_stats(tmp_path, model_path, "all", skip=False)
    assert (s1["pairs_planned"], s1["pairs_trained"]) == (8, 4)
    assert (s2["pairs_planned"], s2["pairs_trained"]) == (8, 8)
    assert skipped.keys() == computed.keys() and skipped
    for n in skipped:  # one pair per micro-batch, the skipped ones add exact zeros: equal to fp32 rounding
        torch.testing.assert_close(skipped[n], computed[n], rtol=1e-6, atol=1e-9, msg=n)
    assert s1["loss"] == pytest.approx(s2["loss"], rel=1e-6, abs=1e-9)
    assert s1["grad_norm"] == pytest.approx(s2["grad_norm"], rel=1e-6)


def test_batch_mean_over_nonzero_pairs_doubles_the_step_when_half_the_pairs_are_zero(tmp_path, model_path):
    """optim.loss_mean=nonzero (flow_grpo's train_sd3.py): the same 4 computed pairs divided by 4 instead of 8, so
    the gradient is exactly 2× the planned mean's (8 planned / 4 non-zero)."""
    planned, sp = _grads_and_stats(tmp_path, model_path, "planned")
    nonzero, sn = _grads_and_stats(tmp_path, model_path, "nonzero", "optim.loss_mean=nonzero")
    assert (sn["pairs_planned"], sn["pairs_trained"]) == (4, 4)
    for n in planned:
        torch.testing.assert_close(nonzero[n], 2.0 * planned[n], rtol=1e-6, atol=1e-9, msg=n)
    assert sn["grad_norm"] == pytest.approx(2.0 * sp["grad_norm"], rel=1e-6)
    assert sn["loss"] == pytest.approx(2.0 * sp["loss"], rel=1e-5, abs=1e-9)
    for k in ("clipfrac", "approx_kl", "ratio_mean"):  # diagnostics: over the computed pairs in both
        assert sn[k] == pytest.approx(sp[k], rel=1e-6, abs=1e-12), k
    assert sp["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # on-policy: exactly 1, not diluted by the skipped pairs


# ---------------------------------------------------------------------------------------------------------------
# A short training run: run folder contents
# ---------------------------------------------------------------------------------------------------------------


def test_train_writes_run_folder(tmp_path, model_path):
    tr = make_trainer(
        tmp_path, model_path, "run.iterations=2", "run.eval_at_end=true", "run.eval_baseline=true", "run.grid_every=1",
        "optim.lr=1e-3",
    )
    tr.reward_fn = ShapesPlusMean(tr.reward_fn)
    result = tr.train()
    out = tmp_path / "run"
    assert result["iterations"] == 2
    recs = read_metrics(out)
    assert [r["iteration"] for r in recs] == [1, 2]
    for r in recs:
        for key in ("reward_mean", "strict_mean", "credit/zero_std_group_ratio", "kl", "clipfrac", "approx_kl", "grad_norm",
                    "nfe_rollout", "reward_calls", "parity_max_abs_dlogp"):
            assert key in r, key
        assert set(r["seconds"]) >= {"rollout", "reward", "credit", "update"}
        assert r["nfe_rollout"] == B * T and r["reward_calls"] == B
        assert r["grad_norm"] > 0 and r["parity_max_abs_dlogp"] < 1e-5
        assert all_finite(r)
    # the resolved config loads back to the same object
    assert load_config(TrainConfig, out / "config.yaml") == tr.cfg
    assert list((out / "tb").glob("events.out.tfevents*"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter000002"]
    assert sorted(p.name for p in (out / "checkpoints" / "iter000002").iterdir()) == ["manifest.json", "state.json", "tensors.safetensors"]
    ck = checkpoint.load(out / "checkpoints" / "iter000002")
    assert ck["iteration"] == 2 and ck["model"].keys() == tr.model.net.state_dict().keys()
    assert (out / "grids" / "iter00001.png").exists() and (out / "grids" / "iter00002.txt").exists()
    ev = json.loads((out / "eval.json").read_text())
    assert set(ev) >= {"trained", "base", "delta"}
    for part in ("trained", "base"):
        assert ev[part]["num_images"] == 216 and "strict_overall" in ev[part] and "correct_overall" in ev[part]
    assert ev["delta"]["reward_mean"] == pytest.approx(ev["trained"]["reward_mean"] - ev["base"]["reward_mean"])
    assert ev["delta"]["strict_overall"] == pytest.approx(ev["trained"]["strict_overall"] - ev["base"]["strict_overall"])
    assert result["eval"]["trained"]["reward_mean"] == ev["trained"]["reward_mean"]
    assert (out / "eval" / "results.jsonl").exists() and (out / "eval_base" / "summary.json").exists()


@pytest.mark.parametrize("method, key", [("stepwise", "credit/gain_abs_mean_per_step"), ("vgpo", "credit/omega_per_step")])
def test_stepwise_and_vgpo_run(tmp_path, model_path, method, key):
    tr = make_trainer(tmp_path, model_path, f"method={method}", "estimate.substeps=2", reward=image_mean_reward)
    assert tr.cfg.credit.name == method and tr.cfg.shared_noise
    seen = spy_update(tr)
    tr.train()
    (rec,) = read_metrics(tmp_path / "run")
    assert isinstance(rec[key], list) and len(rec[key]) == T and all_finite(rec[key])
    assert any(v != 0 for v in rec[key])
    assert rec["pairs_trained"] > 0 and all_finite(rec)
    assert rec["parity_max_abs_dlogp"] < 1e-5  # on-policy ratio 1 for these methods too (C's Must show)
    traj = seen["traj"]
    # shared initial noise within a group
    assert torch.equal(traj.latents[0, 0], traj.latents[1, 0]) and not torch.equal(traj.latents[0, 0], traj.latents[G, 0])
    if method == "stepwise":
        # ρ_j for j = 0..T-1 (ρ_0 once per group, the noise is shared) + the terminal rewards
        assert rec["reward_calls"] == B + B * (T - 1) + P
        assert traj.step_rewards.shape == (B, T + 1)
        assert torch.equal(traj.step_rewards[:, -1], traj.rewards)
        assert rec["nfe_estimates"] > 0
    else:
        assert rec["reward_calls"] == B + B * (T - 1)  # instant rewards of x^(1) … x^(T-1) + terminal


def test_vgpo_instant_rewards_reuse_rollout_velocities(tmp_path, model_path):
    # One-step Tweedie of x^(j+1) needs v(x^(j+1), t_{j+1}), which the rollout already computed: no extra NFE.
    tr = make_trainer(tmp_path, model_path, "method=vgpo", "estimate.instant_substeps=1", reward=image_mean_reward)
    stats = tr.train_step().metrics()
    assert stats["nfe_estimates"] == 0 and stats["reward_calls"] == B + B * (T - 1)


# ---------------------------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------------------------


def test_resume_continues_and_matches_straight_run(tmp_path, model_path):
    common = ("run.checkpoint_every=1", "optim.lr=1e-3")
    first = make_trainer(tmp_path, model_path, "run.iterations=2", *common, out="resume", reward=image_mean_reward)
    first.train()
    out = tmp_path / "resume"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter000001", "iter000002"]

    second = make_trainer(tmp_path, model_path, "run.iterations=3", *common, out="resume", reward=image_mean_reward)
    assert second.iteration == 2
    assert second.train()["iterations"] == 3
    assert [r["iteration"] for r in read_metrics(out)] == [1, 2, 3]
    # the two newest checkpoints are kept
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter000002", "iter000003"]

    straight = make_trainer(tmp_path, model_path, "run.iterations=3", *common, out="straight", reward=image_mean_reward)
    straight.train()
    a, b = second.model.net.state_dict(), straight.model.net.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run differs from the straight run"
    ra, rb = read_metrics(out), read_metrics(tmp_path / "straight")
    assert [r["reward_mean"] for r in ra] == [r["reward_mean"] for r in rb]


def test_checkpoint_every_zero_saves_only_at_the_end(tmp_path, model_path):
    tr = make_trainer(tmp_path, model_path, "run.iterations=2", "run.checkpoint_every=0", reward=image_mean_reward)
    tr.train()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["iter000002"]


# ---------------------------------------------------------------------------------------------------------------
# LoRA on the tiny model: only the adapter trains, the reference is the adapter disabled, checkpoints load merged
# ---------------------------------------------------------------------------------------------------------------


def test_lora_trains_only_the_adapter_and_checkpoints_load_as_a_plain_model(tmp_path, model_path):
    pytest.importorskip("peft")
    from flowcredit.cli.inference import load_any_model

    common = ("model.trainable=lora", "model.lora_rank=4", "model.lora_alpha=8", "optim.kl_beta=0.04", "optim.lr=1e-2",
              "optim.weight_decay=0", "optim.ema_decay=0", "run.checkpoint_every=1")
    tr = make_trainer(tmp_path, model_path, "run.iterations=2", *common, out="lora", reward=image_mean_reward)
    assert tr.ref_model is None  # no frozen copy: π_ref is the model with its adapter disabled
    named = dict(tr.model.net.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    tr.train()
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and trainable == {n for n in named if "lora_" in n}
    changed = {n for n in named if not torch.equal(named[n].detach(), before[n])}
    assert any(".lora_B." in n for n in changed) and changed <= trainable  # base weights frozen
    rows = read_metrics(tmp_path / "lora")
    assert all(r["parity_max_abs_dlogp"] < 1e-5 for r in rows)  # on-policy ratio 1 through the adapter
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-9)  # B = 0: policy = reference
    assert rows[1]["kl"] > 0  # after one update the adapter-disabled reference differs

    loaded = load_any_model(str(tmp_path / "lora"))  # eval/sample path: adapter folded into plain weights
    assert not loaded.has_lora and not any("lora_" in k for k in loaded.net.state_dict())
    g = torch.Generator().manual_seed(5)
    x, t = torch.randn(2, 3, 32, 32, generator=g), torch.rand(2, generator=g)
    cond = tr.model.encode_prompts(["a photo of a red circle", "a photo of a blue square"])
    with torch.no_grad():
        torch.testing.assert_close(loaded.velocity(x, t, cond), tr.model.velocity(x, t, cond), atol=1e-5, rtol=1e-5)

    resumed = make_trainer(tmp_path, model_path, "run.iterations=3", *common, out="lora", reward=image_mean_reward)
    assert resumed.iteration == 2
    a, b = resumed.model.net.state_dict(), tr.model.net.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------------------------
# optim.kl_reference=ema: the KL reference follows the policy as a slow EMA, saved in checkpoints
# ---------------------------------------------------------------------------------------------------------------

EMA_REF = ("optim.kl_beta=0.1", "optim.kl_reference=ema", "optim.kl_reference_decay=0.5", "optim.lr=1e-3")


def trainable_of(model, names):
    named = dict(model.net.named_parameters())
    return [named[n].detach().clone() for n in names]


def test_kl_reference_initial_stays_the_initial_weights(tmp_path, model_path):
    tr = make_trainer(tmp_path, model_path, "optim.kl_beta=0.1", "optim.lr=1e-3", reward=image_mean_reward)
    assert tr.moving_ref is None
    before = {k: v.clone() for k, v in tr.ref_model.net.state_dict().items()}
    tr.train_step().metrics()
    tr.train_step().metrics()
    assert all(torch.equal(before[k], v) for k, v in tr.ref_model.net.state_dict().items())


def test_kl_reference_ema_follows_the_policy_after_every_step(tmp_path, model_path):
    tr = make_trainer(tmp_path, model_path, *EMA_REF, reward=image_mean_reward)
    names = tr.trainable_names
    ref = trainable_of(tr.ref_model, names)
    assert all(torch.equal(r, p) for r, p in zip(ref, trainable_of(tr.model, names)))  # starts at the initial weights
    for _ in range(2):
        stats = tr.train_step().metrics()
        theta = trainable_of(tr.model, names)
        ref = [r.lerp(p, 0.5) for r, p in zip(ref, theta)]  # ref ← 0.5·ref + 0.5·θ
        got = trainable_of(tr.ref_model, names)
        assert all(torch.equal(g, e) for g, e in zip(got, ref))
        assert any(not torch.equal(g, p) for g, p in zip(got, theta))  # behind the policy, not equal to it
    assert stats["kl"] > 0  # the KL is taken to the moving reference
    assert not tr.ref_model.training and not any(p.requires_grad for p in tr.ref_model.parameters())


def test_kl_reference_ema_resumes_exactly(tmp_path, model_path):
    common = (*EMA_REF, "run.checkpoint_every=1")
    first = make_trainer(tmp_path, model_path, "run.iterations=2", *common, out="resume", reward=image_mean_reward)
    first.train()
    st = checkpoint.load(tmp_path / "resume" / "checkpoints" / "iter000002")
    assert st["kl_reference"].keys() == set(first.trainable_names)
    second = make_trainer(tmp_path, model_path, "run.iterations=3", *common, out="resume", reward=image_mean_reward)
    assert second.iteration == 2
    assert all(torch.equal(a, b) for a, b in zip(trainable_of(second.ref_model, second.trainable_names),
                                                 trainable_of(first.ref_model, first.trainable_names)))
    second.train()
    straight = make_trainer(tmp_path, model_path, "run.iterations=3", *common, out="straight",
                            reward=image_mean_reward)
    straight.train()
    for which in ("model", "ref_model"):
        a, b = getattr(second, which).net.state_dict(), getattr(straight, which).net.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), f"resumed run's {which} differs from the straight run"


def test_kl_reference_ema_with_lora_keeps_a_moving_copy_of_the_adapter(tmp_path, model_path):
    pytest.importorskip("peft")
    tr = make_trainer(tmp_path, model_path, "model.trainable=lora", "model.lora_rank=4", "model.lora_alpha=8",
                      "optim.weight_decay=0", "optim.ema_decay=0", *EMA_REF, "optim.lr=1e-2", reward=image_mean_reward)
    assert tr.ref_model is not None and tr.moving_ref is not None  # a copy, not the disabled adapter
    assert all("lora_" in n for n in tr.trainable_names)
    base = {n: p.detach().clone() for n, p in tr.ref_model.net.named_parameters() if "lora_" not in n}
    first = tr.train_step().metrics()
    second = tr.train_step().metrics()
    assert first["kl"] == pytest.approx(0.0, abs=1e-12)  # B = 0 at the start: policy = reference
    assert second["kl"] > 0
    named = dict(tr.ref_model.net.named_parameters())
    assert all(torch.equal(named[n], v) for n, v in base.items())  # the base weights stay the initial ones
    got, theta = trainable_of(tr.ref_model, tr.trainable_names), trainable_of(tr.model, tr.trainable_names)
    assert any(g.abs().sum() > 0 and not torch.equal(g, p) for g, p in zip(got, theta) if g.ndim)


def test_kl_reference_ema_needs_a_kl_term(tmp_path, model_path):
    from flowcredit.config.load import ConfigError

    with pytest.raises(ConfigError, match="optim.kl_reference=ema.*optim.kl_beta=0"):
        make_cfg(tmp_path, model_path, "optim.kl_beta=0", "optim.kl_reference=ema")
    with pytest.raises(ConfigError, match="kl_reference"):
        make_cfg(tmp_path, model_path, "optim.kl_beta=0.1", "optim.kl_reference=moving")


# ---------------------------------------------------------------------------------------------------------------
# nft objective.options.old_policy=soft: DiffusionNFT's soft-updated π_old samples the rollouts and gives v_old
# ---------------------------------------------------------------------------------------------------------------

NFT = ("objective.name=nft", "sampler.name=ode", "optim.lr=1e-3", "sampler.train_step_draw=nft",
       "sampler.train_steps_per_sample=0")
SOFT = (*NFT, "objective.options.old_policy=soft", "objective.options.old_decay_rate=0.25",
        "objective.options.old_decay_max=0.5")


def test_nft_soft_old_policy_samples_the_rollout_and_soft_updates(tmp_path, model_path, monkeypatch):
    import flowcredit.trainer.loop as grpo_module

    tr = make_trainer(tmp_path, model_path, *SOFT, reward=image_mean_reward)
    names = tr.trainable_names
    at_rollout, at_update = [], []
    real_rollout = grpo_module.rollout

    def rollout_spy(model, *args, **kwargs):  # the weights the rollout samples with
        at_rollout.append(trainable_of(model, names))
        return real_rollout(model, *args, **kwargs)

    monkeypatch.setattr(grpo_module, "rollout", rollout_spy)
    seen = spy_update(tr)
    seen["before"] = lambda *a: at_update.append(trainable_of(tr.model, names))
    theta0 = trainable_of(tr.model, names)
    first = tr.train_step().metrics()
    tr.iteration += 1
    theta1 = trainable_of(tr.model, names)
    # iteration 1: π_old = θ_0 = θ; every grid time may be trained (train_step_draw=nft), int(3·0.99) = 2 per sample
    assert all(torch.equal(a, b) for a, b in zip(at_rollout[0], theta0))
    assert bool(seen["traj"].step_mask.all()) and first["pairs_planned"] == B * 2
    assert first["old_deviate"] == pytest.approx(0.0, abs=1e-12)
    # after the update, with k = 1 optimizer step: d = min(0.25·1, 0.5), θ_old ← θ_old·d + θ·(1 − d) (official form)
    assert first["old_policy_decay"] == 0.25 and tr.old_policy.steps == 1
    old1 = [a * 0.25 + b * 0.75 for a, b in zip(theta0, theta1)]
    assert all(torch.equal(a, b) for a, b in zip(tr.old_policy.shadow, old1))
    second = tr.train_step().metrics()
    # iteration 2: the rollout sampled θ_old, not θ_1; the update started from θ_1 again, with v_old ≠ v_θ
    assert all(torch.equal(a, b) for a, b in zip(at_rollout[1], old1))
    assert any(not torch.equal(a, b) for a, b in zip(at_rollout[1], theta1))
    assert all(torch.equal(a, b) for a, b in zip(at_update[1], theta1))
    assert second["old_deviate"] > 0 and second["old_policy_decay"] == 0.5  # min(0.25·2, 0.5)
    assert first["nfe_update"] == second["nfe_update"] == B * 2 * 3  # forward + backward + the v_old forward per pair


def test_nft_soft_old_policy_resumes_exactly(tmp_path, model_path):
    common = (*SOFT, "run.checkpoint_every=1")
    first = make_trainer(tmp_path, model_path, "run.iterations=2", *common, out="resume", reward=image_mean_reward)
    first.train()
    st = checkpoint.load(tmp_path / "resume" / "checkpoints" / "iter000002")
    assert st["old_policy"].keys() == set(first.trainable_names) and st["harness"]["old_policy"] == {"steps": 2}
    second = make_trainer(tmp_path, model_path, "run.iterations=3", *common, out="resume", reward=image_mean_reward)
    assert second.iteration == 2 and second.old_policy.steps == 2
    assert all(torch.equal(a, b) for a, b in zip(second.old_policy.shadow, first.old_policy.shadow))
    second.train()
    straight = make_trainer(tmp_path, model_path, "run.iterations=3", *common, out="straight",
                            reward=image_mean_reward)
    straight.train()
    a, b = second.model.net.state_dict(), straight.model.net.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run's weights differ from the straight run"
    assert all(torch.equal(x, y) for x, y in zip(second.old_policy.shadow, straight.old_policy.shadow))
    ra, rb = read_metrics(tmp_path / "resume"), read_metrics(tmp_path / "straight")
    for key in ("reward_mean", "loss", "old_deviate", "old_policy_decay"):
        assert [r[key] for r in ra] == [r[key] for r in rb], key


def test_nft_soft_old_policy_without_decay_trains_as_the_current_policy(tmp_path, model_path):
    # d = 0: θ_old = θ after every iteration, so the rollout and v_old are the current policy's (old_policy=current);
    # only the v_old pass is a separate forward (the same values) and no zero-advantage pair is skipped
    cur = make_trainer(tmp_path, model_path, "run.iterations=2", *NFT, out="current", reward=image_mean_reward)
    soft = make_trainer(tmp_path, model_path, "run.iterations=2", *NFT, "objective.options.old_policy=soft",
                        "objective.options.old_decay_rate=0", "objective.options.old_decay_max=0", out="soft0",
                        reward=image_mean_reward)
    cur.train()
    soft.train()
    a, b = cur.model.net.state_dict(), soft.model.net.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert [r["old_deviate"] for r in read_metrics(tmp_path / "soft0")] == pytest.approx([0.0, 0.0], abs=1e-12)


def test_nft_soft_old_policy_estimates_step_rewards_with_the_old_weights(tmp_path, model_path, monkeypatch):
    # step-level credit (stepwise, 2-substep x̂0 estimates that call the model): the estimates see π_old's weights
    import flowcredit.trainer.loop as grpo_module

    tr = make_trainer(tmp_path, model_path, *SOFT, "method=stepwise", "estimate.substeps=2", reward=image_mean_reward)
    real, seen = grpo_module.intermediate_rewards, []

    def spy(model, *args, **kwargs):
        seen.append(trainable_of(model, tr.trainable_names))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(grpo_module, "intermediate_rewards", spy)
    tr.train_step().metrics()
    tr.iteration += 1
    old = [t.clone() for t in tr.old_policy.shadow]
    stats = tr.train_step().metrics()
    assert all(torch.equal(a, b) for a, b in zip(seen[1], old)) and math.isfinite(stats["loss"])


def test_nft_soft_old_policy_with_lora_keeps_a_second_adapter(tmp_path, model_path):
    pytest.importorskip("peft")
    tr = make_trainer(tmp_path, model_path, *SOFT, "model.trainable=lora", "model.lora_rank=4", "model.lora_alpha=8",
                      "optim.lr=1e-2", reward=image_mean_reward)
    assert tr.trainable_names and all("lora_" in n for n in tr.trainable_names)
    assert [t.shape for t in tr.old_policy.shadow] == [p.shape for p in tr.trainable]  # the adapter only
    tr.train_step().metrics()
    tr.iteration += 1
    assert tr.train_step().metrics()["old_deviate"] > 0


def test_awm_released_recipe_trains_with_the_ramped_ema_reference(tmp_path, model_path):
    # AWM's released recipe on the tiny model: ghuber p = 0.25, A/5, clip 1, KL to an EMA reference whose decay ramps
    # as min(r·k, d) (here r = 0.1, d = 0.3, so the ramp is visible in 2 steps); the step count is checkpointed
    recipe = ("objective.name=awm", "sampler.name=ode", "objective.options.weighting=ghuber",
              "objective.options.adv_clip_max=5", "objective.options.advantage_max=1",
              "objective.options.clip_range=1.0", "optim.kl_beta=1.0", "optim.kl_reference=ema",
              "optim.kl_reference_decay=0.3", "optim.kl_reference_decay_rate=0.1", "optim.lr=1e-3",
              "run.checkpoint_every=1")
    tr = make_trainer(tmp_path, model_path, "run.iterations=2", *recipe, reward=image_mean_reward)
    names = tr.trainable_names
    ref = trainable_of(tr.ref_model, names)
    for k in (1, 2):
        stats = tr.train_step().metrics()
        tr.iteration += 1
        d = min(0.1 * k, 0.3)
        ref = [r.lerp(p, 1 - d) for r, p in zip(ref, trainable_of(tr.model, names))]
        assert all(torch.equal(g, e) for g, e in zip(trainable_of(tr.ref_model, names), ref))
        assert math.isfinite(stats["loss"]) and stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["kl"] > 0
    tr.save_checkpoint()
    st = checkpoint.load(tmp_path / "run" / "checkpoints" / "iter000002")
    assert st["harness"]["kl_reference"] == {"steps": 2}
    resumed = make_trainer(tmp_path, model_path, "run.iterations=3", *recipe, reward=image_mean_reward)
    assert resumed.iteration == 2 and resumed.moving_ref.steps == 2


def test_budget_stops_training_in_time_for_the_final_evaluation(tmp_path, model_path):
    """run.budget_minutes: the first iteration always runs; afterwards training stops once one more iteration plus
    the predicted final evaluation would overrun the budget, and the evaluation still runs (eval.json written)."""
    tr = make_trainer(tmp_path, model_path, "run.iterations=50", "run.budget_minutes=0.001", "run.eval_at_end=true",
                      "run.eval_baseline=true", "run.checkpoint_every=0")
    per_model = len(tr.eval_prompts) * tr.cfg.run.eval_steps
    assert tr.eval_forwards() == 2 * per_model  # trained + initial model, no baseline cache
    result = tr.train()
    assert result["iterations"] == 1 and result["stopped_by_budget"] is True
    assert (tr.out / "eval.json").is_file()


def test_budget_prediction_uses_the_measured_rates(tmp_path, model_path, monkeypatch):
    tr = make_trainer(tmp_path, model_path, "run.budget_minutes=1.0", "run.eval_at_end=true", "run.eval_baseline=false")
    fwd = tr.eval_forwards()
    assert fwd == len(tr.eval_prompts) * tr.cfg.run.eval_steps  # trained model only
    now = tr.t_created + 30.0
    monkeypatch.setattr("flowcredit.trainer.loop.time.time", lambda: now)
    # 30 s elapsed + 5 s per iteration + (1.1 · fwd / rate + 10 s) of evaluation vs a 60 s budget
    fits = fwd / ((60 - 30 - 5 - 10 - 1) / 1.1)  # a rate that leaves 1 s spare
    assert over_budget(tr, [5.0, 5.0, 5.0], [fits, fits]) is False
    assert over_budget(tr, [5.0, 5.0, 5.0], [fits / 2, fits / 2]) is True
    assert over_budget(tr, [], []) is False  # nothing measured yet: the first iteration runs
    tr.budget.budget_s = 0.0  # harness.TimeBudget of run.budget_minutes = 0
    assert over_budget(tr, [5.0], [1e-9]) is False  # no budget


def test_lr_schedule_sets_the_optimizer_lr_each_update(tmp_path, model_path):
    # optim.lr_schedule=cosine over run.iterations: the lr of iteration i is lr·[f + (1 − f)(1 + cos(πi/N))/2]
    tr = make_trainer(
        tmp_path, model_path, "run.iterations=4", "optim.lr=1e-3", "optim.lr_schedule=cosine", "optim.lr_final=0.0",
        reward=image_mean_reward,
    )
    lrs = []
    for i in range(4):
        stats = tr.train_step().metrics()
        tr.iteration += 1
        lrs.append(stats["lr"])
        assert tr.opt.param_groups[0]["lr"] == pytest.approx(stats["lr"])
    assert lrs == pytest.approx([1e-3, 8.53553391e-4, 5e-4, 1.46446609e-4])  # (1 + cos(πi/4)) / 2, by hand
    # the constant default never touches the optimizer's lr and logs none (golden runs unchanged)
    tr2 = make_trainer(tmp_path, model_path, "optim.lr=1e-3", reward=image_mean_reward, out="run2")
    assert "lr" not in tr2.train_step().metrics() and tr2.opt.param_groups[0]["lr"] == 1e-3


def test_lr_decay_iterations_sets_the_schedules_length_not_the_runs(tmp_path, model_path):
    # optim.lr_decay_iterations=2 caps the decay of a 3-iteration run: cosine over 2 iterations, then lr·lr_final
    tr = make_trainer(
        tmp_path, model_path, "run.iterations=3", "optim.lr=1e-3", "optim.lr_schedule=cosine", "optim.lr_final=0.1",
        "optim.lr_decay_iterations=2", reward=image_mean_reward,
    )
    lrs = []
    for _ in range(3):
        lrs.append(tr.train_step().metrics()["lr"])
        tr.iteration += 1
    assert lrs == pytest.approx([1e-3, 1e-3 * (0.1 + 0.9 * 0.5), 1e-4])
    assert tr.opt.param_groups[0]["lr"] == pytest.approx(1e-4)
    # a cap above run.iterations changes nothing: the decay still spans the run (here 2 iterations)
    tr2 = make_trainer(
        tmp_path, model_path, "run.iterations=2", "optim.lr=1e-3", "optim.lr_schedule=cosine", "optim.lr_final=0.1",
        "optim.lr_decay_iterations=400", reward=image_mean_reward, out="run2",
    )
    assert tr2.lr_schedule(1) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))


def test_periodic_eval_of_the_whole_split_uses_the_final_evaluations_noise(tmp_path, model_path):
    # run.eval_subset ≥ the split: the periodic point of the last iteration and eval.json score the same weights on
    # the same lines with the same noise, so they agree exactly (a tag-balanced reorder would change every line's noise)
    tr = make_trainer(
        tmp_path, model_path, "run.iterations=1", "run.eval_every=1", "run.eval_subset=100000", "run.eval_at_end=true",
        "run.eval_baseline=false", reward=image_mean_reward,
    )
    result = tr.train()
    curve = [json.loads(x) for x in (tmp_path / "run" / "eval_curve.jsonl").read_text().splitlines()]
    assert curve[-1]["iteration"] == 1
    assert curve[-1]["eval_reward"] == pytest.approx(result["eval"]["trained"]["reward_mean"], abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# AWM's released recipe, both differences closed: optim.kl_base_beta (a second KL to the initial weights beside the
# EMA reference) and sampler.train_step_draw=awm (discrete_wo_init: one step per stratum, never step 0)
# ---------------------------------------------------------------------------------------------------------------

AWM_BOTH = ("objective.name=awm", "sampler.name=ode", "sampler.num_steps=5", "sampler.train_step_draw=awm",
            "sampler.train_steps_per_sample=2", "optim.kl_beta=1", "optim.kl_reference=ema",
            "optim.kl_reference_decay=0.5", "optim.kl_base_beta=0.5", "optim.lr=1e-3",
            "objective.options.clip_range=1.0")


def test_awm_two_kl_terms_and_awm_step_draw_train(tmp_path, model_path, monkeypatch):
    import flowcredit.trainer.loop as grpo_mod

    tr = make_trainer(tmp_path, model_path, *AWM_BOTH, "run.iterations=2", reward=image_mean_reward)
    assert tr.base_model is not None and tr.ref_model is not None and tr.base_model is not tr.ref_model
    initial = {k: v.clone() for k, v in tr.model.net.state_dict().items()}
    plans = []
    real_plan = grpo_mod.plan_update

    def plan_spy(*a, **k):
        plans.append(real_plan(*a, **k))
        return plans[-1]

    monkeypatch.setattr(grpo_mod, "plan_update", plan_spy)
    stats = [tr.train_step().metrics(), tr.train_step().metrics()]
    assert stats[0]["kl_base"] == pytest.approx(0.0, abs=1e-12)  # θ = the initial weights during the first update
    assert stats[1]["kl_base"] > 0 and stats[1]["kl"] > 0 and all(all_finite(s) for s in stats)
    # the base copy stays the initial weights while the EMA reference moves
    assert all(torch.equal(initial[k], v) for k, v in tr.base_model.net.state_dict().items())
    assert any(not torch.equal(initial[k], v) for k, v in tr.ref_model.net.state_dict().items())
    assert len(plans) == 2
    for _, _, epochs in plans:  # 2 steps per sample, from the strata [1, 2) and [2, 4) of the 4 trainable ones
        pairs = [p for chunk in epochs[0] for p in chunk.pairs]
        assert sorted(b for b, _ in pairs) == sorted(list(range(B)) * 2)
        assert {j for _, j in pairs} <= {1, 2, 3}
        assert all(sorted(j for bb, j in pairs if bb == b)[0] == 1 for b in range(B))  # step 1 always, 0 never
    assert stats[1]["pairs_planned"] == B * 2


def test_awm_kl_base_with_lora_uses_the_disabled_adapter(tmp_path, model_path):
    pytest.importorskip("peft")
    tr = make_trainer(tmp_path, model_path, *AWM_BOTH, "model.trainable=lora", "model.lora_rank=4",
                      "model.lora_alpha=8", "optim.weight_decay=0", "optim.ema_decay=0", "optim.lr=1e-2",
                      reward=image_mean_reward)
    assert tr.base_model is None  # no copy: `model.reference()` disables the adapter
    tr.train_step().metrics()
    stats = tr.train_step().metrics()
    assert stats["kl_base"] > 0


def test_awm_options_config_errors_are_one_line(tmp_path, model_path):
    from flowcredit.config.load import ConfigError

    cases = [
        (("objective.name=awm", "sampler.name=ode", "optim.kl_beta=1", "optim.kl_base_beta=0.1"),
         "optim.kl_base_beta=0.1 adds a KL to the initial weights.*optim.kl_reference=ema"),
        (("optim.kl_beta=1", "optim.kl_reference=ema", "optim.kl_base_beta=0.1"),
         "kl_base_beta=0.1.*objective.name=nft|awm.*not 'grpo'"),
        (("objective.name=awm", "sampler.name=ode", "sampler.num_steps=5", "sampler.train_step_draw=awm",
          "sampler.train_steps_per_sample=4"), "train_step_draw=awm.*steps 1..3.*use 1 to 3"),
        (("objective.name=awm", "sampler.name=ode", "sampler.train_step_draw=awm", "sampler.train_steps_per_sample=0"),
         "train_steps_per_sample=0"),
        (("sampler.train_step_draw=awm", "sampler.train_steps_per_sample=1"),
         "train_step_draw=awm.*objective.name=grpo"),
        (("optim.kl_base_beta=-1",), "optim.kl_base_beta"),
    ]
    for overrides, match in cases:
        with pytest.raises(ConfigError, match=match) as e:
            make_cfg(tmp_path, model_path, *overrides)
        assert "\n" not in str(e.value), str(e.value)


def test_stepwise_drawn_states_estimate_only_what_the_drawn_pairs_need(tmp_path, model_path):
    """credit.options.states=drawn: the update's pairs are drawn first; only the states x^(j), x^(j+1) of the drawn
    pairs are estimated and scored; advantages are non-zero only on drawn pairs; the same pairs are trained."""
    from flowcredit.trainer.intermediate import drawn_mask

    steps = 8  # 7 trainable steps, 3 drawn per sample: most states are not needed
    common = ("method=stepwise", "estimate.substeps=2", f"sampler.num_steps={steps}")
    full = make_trainer(tmp_path, model_path, *common, out="all", reward=image_mean_reward)
    drawn = make_trainer(tmp_path, model_path, *common, "credit.options.states=drawn", out="drawn",
                         reward=image_mean_reward)
    seen = spy_update(drawn)
    m_all, m_drawn = full.train_step().metrics(), drawn.train_step().metrics()
    pairs = drawn._draw_pairs(seen["traj"])
    assert len(pairs) == B * 3 and m_drawn["pairs_planned"] == m_all["pairs_planned"] == B * 3
    nonzero = {(int(b), int(j)) for b, j in zip(*torch.nonzero(seen["adv"], as_tuple=True))}
    assert nonzero and nonzero <= set(pairs)  # no advantage outside the drawn pairs
    # the NFEs of the estimates: one call per estimated state (T′ = 2, the rollout velocity reused), a group's shared
    # state 0 once, ×2 for CFG; the full arm estimates all 8 states (state 0 once per group)
    _, states = drawn_mask(pairs, B, steps)
    groups_at_0 = {int(g) for g, need in zip(seen["traj"].group_ids, states[:, 0]) if need}
    n_states = int(states[:, 1:].sum()) + len(groups_at_0)
    cfg_mult = 2 if drawn.cfg.sampler.guidance_scale != 1.0 else 1
    assert m_drawn["nfe_estimates"] == n_states * cfg_mult
    assert m_all["nfe_estimates"] == (B * (steps - 1) + P) * cfg_mult > m_drawn["nfe_estimates"]
    assert m_drawn["reward_calls"] == B + n_states and m_drawn["credit/drawn_gains"] == B * 3
