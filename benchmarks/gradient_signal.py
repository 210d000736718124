"""Does step-level credit make the policy gradient learn faster, and where? A paired gradient-signal study.

    python benchmarks/gradient_signal.py --iters K [--minutes M] [--weights shipped|PATH] [--arms SET[/ARM]...] --out D
    python benchmarks/gradient_signal.py --from-json D/gradient_signal.json     # the table again, from the raw data

For every credit arm, K independent iterations (new prompts, new rollouts) at the SAME weights (nothing moves), and
every arm of a rollout set scored on the SAME rollouts, the same trained (sample, step) pairs and the same
forward-process draws (ε, t): only the credit (the advantages A[b, j]) differs between the arms of a set. With g_i^a
arm a's gradient of iteration i = s_a + n_i^a (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"):

    <s_a, s_b> ≈ C_ab = mean_{i≠j} <g_i^a, g_j^b>       unbiased: different iterations have independent noise
    ρ_a       = C_aa / mean_i |g_i^a|²                   signal fraction of one iteration's gradient energy
    B_noise   = B · (1/ρ − 1)                            samples at which one step's gradient is half signal
    cos_rest  = mean_i cos(g_i^a, Σ_{j≠i} g_j^a)         one iteration against the direction of all the others (K-dep.)
    cos_sig   = C_ab / sqrt(C_aa·C_bb)                   the cosine between two arms' expected gradients (the
                                                         same-iteration noise the arms share is left out by i ≠ j)

Intervals: a percentile bootstrap over iterations (multinomial weights w; a resampled iteration is never paired with
a copy of itself in the i ≠ j sums); ratios ρ_a/ρ_ref resample the iterations jointly over the arms of a set (paired).
Everything is a function of the Gram matrix of the K·n_arms gradients, which the JSON keeps.

Why pairing is exact and cheap: on-policy at the current weights (first optimizer step, optim.kl_beta = 0), every
objective's per-pair gradient is affine in the pair's advantage: grpo's clipped surrogate at ratio 1 has gradient
−A·∇ratio; nft's r|v⁺−u|² + (1−r)|v⁻−u|² is affine in r = A/(2m) + 1/2 (|A| ≤ m = 5, what the credit's ±5 clip
guarantees), and zero at r = 1/2 on-policy. So with ℓ1_p the pair's loss at A = 1 (and ℓ0_p at A = 0) arm a's update
gradient is ∇ Σ_p [ℓ0_p + A^a_p·(ℓ1_p − ℓ0_p)] / N_planned: one forward per pair, one backward per arm (retained
graph), whatever the number of arms. Where `objective.skip_zero_advantage` says an A = 0 pair has exactly zero gradient
(grpo and nft on-policy without KL, as here) ℓ0 is not computed (tests/benchmarks/test_gradient_signal.py checks
g(A = 2) = 2·g1 − g0 and g0 = 0 numerically). The pairs are `distributed.plan_update`'s draw of the iteration (the
trainer's: sampler.train_steps_per_sample per sample, nft's crn per group), the same for every arm; N_planned counts
them all, so a zero-advantage pair contributes nothing but is in the mean, as optim.loss_mean = planned trains it.

Parameters: the gradient is taken on the conditioning path only (model.trainable = modulation: t_mlp, pool_mlp,
every block's adaLN modulation and ada_out, 1.1 M of the 3.4 M weights; what tiny_nft trains and ≈ 75% of the signal,
ALGORITHMS.md §9.4), for every arm and objective, so the ρ of grpo and nft arms are on the same coordinates. The grpo
presets train all weights: their ρ on all weights is lower than the one measured here. optim.kl_beta = 0 for every
set (tiny_nft trains with β = 0.25; at the shipped weights the KL's gradient is exactly 0, v_θ = v_ref, and it is the
same for every arm of a set at any weights: it is not credit). The gradient is before optim.grad_clip.

NFEs per sample of an arm (the compute to one signal-dominated step is B_noise × NFE/sample): rollout (T per sample)
+ the arm's x̂0 estimates (T′ − 1 per state; T′ = 1 reuses the rollout's velocities) + update (forward + backward = 2
per computed pair: pairs with A ≠ 0, the trainer skips the others). Reward calls on x̂0 estimates are no NFEs; they
are reported next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------------- the arms
# A rollout set: one preset (its sampler and objective: the rollouts, pairs and ε every arm of the set shares) and the
# arms (overrides of that preset that may change the credit and what it needs estimated, nothing else; checked).
# The first arm is the set's reference (ratios and cosines are taken to it).
COMMON = ["run.eval_at_end=false", "run.grid_every=0", "run.checkpoint_every=0", "run.budget_minutes=0",
          "optim.inner_epochs=1", "optim.updates_per_epoch=1", "optim.kl_beta=0", "model.trainable=modulation"]
STEPWISE_T1 = ["method=stepwise", "estimate.substeps=1"]
STEPWISE_T5 = ["method=stepwise", "estimate.substeps=5"]
# the grpo rollouts (tiny_flow_grpo, one x_T per group) that the grpo, stepwise_variants and vgpo_ablation sets share
GRPO_ROLLOUTS = {"preset": "tiny_flow_grpo", "overrides": ["sampler.shared_noise=true"]}
SETS: dict[str, dict[str, Any]] = {
    # grpo on tiny_flow_grpo's SDE (flow_sde, a = 0.7, 3 random trained steps per sample); x_T shared within a group
    # (the stepwise/vgpo presets' rollouts: a group's ρ_0 is then one value and the gains telescope to R − const)
    "grpo": {**GRPO_ROLLOUTS, "arms": {
        "flow_grpo": [],
        "stepwise_t1_joint": [*STEPWISE_T1, "credit.options.norm=joint"],
        "stepwise_t1_per_step": [*STEPWISE_T1, "credit.options.norm=per_step"],
        "stepwise_t5_joint": [*STEPWISE_T5, "credit.options.norm=joint"],
        "stepwise_t5_per_step": [*STEPWISE_T5, "credit.options.norm=per_step"],
        "vgpo": ["method=vgpo", "estimate.instant_substeps=1"],
        "flow_grpo_adae": ["credit.anchor=adae", "estimate.instant_substeps=1"],
    }},
    # grpo on the DDIM-style SDE (tiny_stepwise_ddim: σ = η(t−Δt)√(1−t), η = 0.9), its own rollouts
    "ddim": {"preset": "tiny_stepwise_ddim", "overrides": [], "arms": {
        "flow_grpo": ["method=flow_grpo", "credit.options={}"],  # the preset's options are stepwise's
        "stepwise_t5_joint": [],
    }},
    # Stepwise's own design choices on the grpo set's rollouts, paired against the paper's default (T′ = 5, plain
    # gains, joint normalisation): T′ ∈ {1, 2, 3} (§6.2 / App. C.2), GAE over the gains and the EMA baseline (App. A)
    "stepwise_variants": {**GRPO_ROLLOUTS, "arms": {
        "stepwise_t5_joint": [*STEPWISE_T5, "credit.options.norm=joint"],
        "stepwise_t1_joint": [*STEPWISE_T1, "credit.options.norm=joint"],
        "stepwise_t2_joint": ["method=stepwise", "estimate.substeps=2", "credit.options.norm=joint"],
        "stepwise_t3_joint": ["method=stepwise", "estimate.substeps=3", "credit.options.norm=joint"],
        "stepwise_t5_gae": [*STEPWISE_T5, "credit.options.norm=joint", "credit.options.use_gae=true",
                            "credit.options.gae_gamma=1.0", "credit.options.gae_lambda=0.95"],
        "stepwise_t5_ema": [*STEPWISE_T5, "credit.options.norm=joint", "credit.options.baseline=ema"],
    }},
    # VGPO's ablation (its Tab. 2) on the grpo set's rollouts: TCRM alone (adae_k = 0), ADAE alone (the anchor on
    # sample-level credit), both (the method)
    "vgpo_ablation": {**GRPO_ROLLOUTS, "arms": {
        "flow_grpo": [],
        "vgpo": ["method=vgpo", "estimate.instant_substeps=1"],
        "vgpo_tcrm_only": ["method=vgpo", "estimate.instant_substeps=1", "credit.options.adae_k=0"],
        "flow_grpo_adae": ["credit.anchor=adae", "estimate.instant_substeps=1"],
    }},
    # nft (tiny_nft: ODE rollouts, crn, 3 systematic times per sample), the credit_nft study's credit designs
    "nft": {"preset": "tiny_nft", "overrides": [], "arms": {
        "flow_grpo": [],
        "stepwise_t1_joint": [*STEPWISE_T1, "credit.options.norm=joint"],
        "stepwise_t1_per_step": [*STEPWISE_T1, "credit.options.norm=per_step"],
        "to_go": [*STEPWISE_T1, "credit.options.use_gae=true", "credit.options.gae_gamma=1.0",
                  "credit.options.gae_lambda=1.0", "credit.options.norm=per_step_mean"],
        "vgpo": ["method=vgpo", "estimate.instant_substeps=1"],
    }},
}


def _cfg_dict(x: Any) -> Any:
    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else dict(vars(x))


def load_cfg(preset: str, overrides: Sequence[str]):
    """`config.load_config(TrainConfig, preset, overrides)` with the shipped presets."""
    import flowcredit.credit  # noqa: F401  (registers the credit methods, so their options are checked)
    from flowcredit.cli.main import PRESET_DIR
    from flowcredit.config import load_config
    from flowcredit.config.schema import TrainConfig

    return load_config(TrainConfig, preset, list(overrides), preset_dirs=[PRESET_DIR])


@dataclasses.dataclass
class Arm:
    name: str
    cfg: Any  # the arm's full TrainConfig (its credit and estimate sections are what differ)
    credit_state: dict = dataclasses.field(default_factory=dict)  # carried across iterations (the EMA baseline)


def build_arms(set_name: str, spec: dict[str, Any], base: list[str], only: Sequence[str] | None) -> list[Arm]:
    """The arms of a set (the reference first, always), each checked to share the set's rollouts and objective."""
    set_cfg = load_cfg(spec["preset"], base)
    arms = []
    for i, (name, ov) in enumerate(spec["arms"].items()):
        if i > 0 and only is not None and name not in only:
            continue
        cfg = load_cfg(spec["preset"], [*base, *ov])
        for section in ("sampler", "objective", "data", "model"):
            if _cfg_dict(getattr(cfg, section)) != _cfg_dict(getattr(set_cfg, section)):
                raise ValueError(f"{set_name}/{name}: its {section} differs from the set's; the arms must share it")
        if cfg.shared_noise != set_cfg.shared_noise:
            raise ValueError(f"{set_name}/{name}: shared_noise differs from the set's")
        arms.append(Arm(name, cfg))
    return arms


# ------------------------------------------------------------------------------------------ one iteration's gradients
def load_weights(model, weights: str) -> str:
    """Load `weights` ("shipped": the preset's initial weights, else a checkpoint folder or a run folder, whose newest
    intact checkpoint is used) into model.net; returns what was loaded."""
    if weights == "shipped":
        return "shipped"
    from flowcredit import checkpoints

    path = Path(weights)
    if (path / "checkpoints").is_dir():
        latest = checkpoints.find_latest(path / "checkpoints")
        if latest is None:
            raise FileNotFoundError(f"no checkpoint under {path / 'checkpoints'}")
        path = latest
    st = checkpoints.load(path)
    model.net.load_state_dict(st["model"])
    return f"{path} (iteration {st.get('iteration')}, raw weights)"


def _timer(_name: str):
    return contextlib.nullcontext()


def _no_reference():
    raise RuntimeError("optim.kl_beta = 0: no reference forward expected")


@dataclasses.dataclass
class IterationOut:
    grads: list[torch.Tensor]  # per arm, (P,) fp32
    arm_stats: list[dict[str, float]]
    stats: dict[str, Any]


def rollout_batch(tr, it: int):
    """This iteration's prompts, conditioning and trajectory, exactly as `Trainer.rollout` draws them."""
    from flowcredit.samplers.rollout import rollout
    from flowcredit.trainer.distributed import layout_noise, step_draw_window
    from flowcredit.types import cond_repeat

    cfg, model = tr.cfg, tr.model
    prompts, meta, gids = tr.shard.draw(tr.prompt_sampler)
    B = len(prompts)
    model.eval()
    cond = model.encode_prompts(prompts)
    uncond = cond_repeat(tr.uncond1, B) if tr.uncond1 is not None else None
    T = len(tr.timesteps) - 1
    init, noise = layout_noise(cfg.run.seed, it, tr.shard, model.latent_shape, T, cfg.shared_noise)
    s = cfg.sampler
    traj = rollout(model, prompts, meta, gids, timesteps=tr.timesteps, sampler=tr.params,
                   guidance_scale=s.guidance_scale, generator=None, init_noise=init, step_noise=noise, cond=cond,
                   uncond=uncond, keep_velocities=True, train_fraction=s.timestep_fraction,
                   ode_untrained=s.ode_untrained)
    fraction, _ = step_draw_window(s.train_step_draw, T, s.timestep_fraction, s.train_steps_per_sample)
    traj.step_mask = tr.objective.trained_steps(traj, fraction)
    return prompts, meta, gids, cond, uncond, traj


def estimate_key(cfg) -> tuple:
    """What an arm needs besides R(x0): (step-reward substeps or 0, instant-reward substeps or 0)."""
    from flowcredit.credit.registry import needs_instant_rewards, needs_step_rewards

    step = cfg.estimate.substeps if needs_step_rewards(cfg.credit) else 0
    same = step == cfg.estimate.instant_substeps  # the instant rewards are then ρ_{j+1} (intermediate.py)
    inst = cfg.estimate.instant_substeps if needs_instant_rewards(cfg.credit) and not same else 0
    return step, inst


def arm_gradients(tr, arms: list[Arm], it: int, check_zero: bool = False) -> IterationOut:
    """Iteration `it` (1-based, the trainer's seeding) of a set: one rollout, every arm's credit on it, the shared
    pair plan and forward draws, and every arm's update gradient on `tr.trainable` (flattened, fp32)."""
    from flowcredit.credit.base import CreditInput
    from flowcredit.credit.registry import assign_credit
    from flowcredit.objectives import LossContext
    from flowcredit.samplers.policy import nfe_per_sample
    from flowcredit.trainer.distributed import plan_update, step_draw_window
    from flowcredit.trainer.intermediate import intermediate_rewards

    cfg, model, obj = tr.cfg, tr.model, tr.objective
    sec: dict[str, float] = {}
    t0 = time.perf_counter()
    prompts, meta, gids, cond, uncond, traj = rollout_batch(tr, it)
    B, T = traj.batch_size, traj.num_steps
    guidance = cfg.sampler.guidance_scale
    nfe1 = nfe_per_sample(uncond, guidance)
    sec["rollout"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rewards = tr.reward_fn(model.decode(traj.latents[:, -1]), prompts, meta, group_ids=gids).scores.float()
    traj.rewards = rewards
    sec["reward"] = time.perf_counter() - t0

    def score(images, p, m):
        return tr.reward_fn(images, p, m).scores.float()

    cache: dict[tuple, tuple] = {}
    advs, arm_stats = [], []
    for arm in arms:
        key = estimate_key(arm.cfg)
        if key not in cache:
            t0 = time.perf_counter()
            if key == (0, 0):
                cache[key] = (None, None, 0, 0)
            else:
                sr, inst, counts = intermediate_rewards(model, score, traj, cond, uncond, arm.cfg, prompts, meta,
                                                        gids, _timer)
                cache[key] = (sr, inst, counts.nfe, counts.calls)
            sec[f"estimates_{key[0]}_{key[1]}"] = time.perf_counter() - t0
        sr, inst, est_nfe, calls = cache[key]
        out = assign_credit(arm.cfg.credit, CreditInput(rewards=rewards, group_ids=gids, step_mask=traj.step_mask,
                                                        step_rewards=sr, instant_rewards=inst,
                                                        state=arm.credit_state))
        arm.credit_state = out.state
        advs.append(out.advantages.float())
        arm_stats.append({"est_nfe": est_nfe / B, "est_reward_calls": calls / B})
    adv = torch.stack(advs)  # (n_arms, B, T)

    # the iteration's pair plan (the trainer's draw; the same for every arm) and the forward draws
    s = cfg.sampler
    _, k = step_draw_window(s.train_step_draw, T, s.timestep_fraction, s.train_steps_per_sample)
    groups = gids.tolist() if getattr(obj, "shares_steps_in_group", False) else None
    n_pairs, _, epochs = plan_update(adv[0], traj.step_mask, tr.shard, seed=cfg.run.seed, iteration=it,
                                     inner_epochs=1, updates_per_epoch=1, skip_zero_adv=False, steps_per_sample=k,
                                     step_groups=groups, step_draw=s.train_step_draw)
    pairs = [p for chunk in epochs[0] for p in chunk.pairs]
    ctx = LossContext(model=model, traj=traj, cond=cond, uncond=uncond, guidance=guidance, params=tr.params,
                      reference=_no_reference, on_policy=True, seed=cfg.run.seed, iteration=it, kl_beta=0.0,
                      micro_batch=cfg.optim.micro_batch, ref_offload=None, row_start=0, batch_global=B)
    t0 = time.perf_counter()
    model.train()
    prep_nfe = obj.prepare(ctx, pairs)
    if getattr(obj, "start_step", None) is not None:
        obj.start_step(ctx, pairs)
    zero_free = obj.skip_zero_advantage(True, 0.0)  # an A = 0 pair has exactly zero gradient: no ℓ0 needed
    params = list(tr.trainable)
    flat = [torch.zeros(sum(p.numel() for p in params), dtype=torch.float32) for _ in arms]
    g0_max = 0.0
    mb = cfg.optim.micro_batch
    for s0 in range(0, len(pairs), mb):
        bi = torch.tensor([p[0] for p in pairs[s0 : s0 + mb]])
        ji = torch.tensor([p[1] for p in pairs[s0 : s0 + mb]])
        n = len(bi)
        l1 = obj.loss(ctx, bi, ji, torch.ones(n)).loss
        l0 = None if zero_free and not check_zero else obj.loss(ctx, bi, ji, torch.zeros(n)).loss
        if l0 is not None and zero_free:  # check_zero: measure ∇Σℓ0, then treat it as the 0 it must be
            g0 = torch.autograd.grad(l0.sum(), params, retain_graph=True, allow_unused=True)
            g0_max = max(g0_max, max(float(g.abs().max()) for g in g0 if g is not None))
            l0 = None
        for a in range(len(arms)):
            w = adv[a, bi, ji] / n_pairs
            loss = (w * l1).sum() if l0 is None else ((1 - adv[a, bi, ji]) * l0 + adv[a, bi, ji] * l1).sum() / n_pairs
            gs = torch.autograd.grad(loss, params, retain_graph=a < len(arms) - 1, allow_unused=True)
            flat[a] += torch.cat([(g if g is not None else torch.zeros_like(p)).flatten().float()
                                  for g, p in zip(gs, params)])
    sec["update"] = time.perf_counter() - t0
    for a, st in enumerate(arm_stats):
        nz = int((adv[a][torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])] != 0).sum())
        st["pairs_nonzero"] = nz
        st["update_nfe"] = (nz * nfe1 * 2 + prep_nfe) / B  # the trainer skips A = 0 pairs (forward + backward = 2)
        st["rollout_nfe"] = T * nfe1
        st["nfe_per_sample"] = st["rollout_nfe"] + st["est_nfe"] + st["update_nfe"]
        st["adv_abs_mean"] = float(adv[a][:, traj.step_mask].abs().mean())
    zero_groups = sum(int(rewards[gids == g].std(correction=0) == 0) for g in gids.unique())
    stats = {"seconds": sec, "pairs": n_pairs, "reward_mean": float(rewards.mean()),
             "zero_std_groups": zero_groups / len(gids.unique()), "g0_max_abs": g0_max if check_zero else None}
    return IterationOut(flat, arm_stats, stats)


def make_trainer(spec: dict[str, Any], base: list[str], weights: str, out: Path):
    from flowcredit.trainer.loop import Trainer

    tr = Trainer(load_cfg(spec["preset"], [*base, f"run.out_dir={out}"]), spec["preset"])
    tr.setup()
    loaded = load_weights(tr.model, weights)
    return tr, loaded


def run_set(set_name: str, arms_only: Sequence[str] | None, iters: int, threads: int, weights: str,
            first_iter: int = 1, check_zero: bool = True, progress=print, minutes: float = 0.0,
            extra: Sequence[str] = (), on_partial=None) -> dict[str, Any]:
    """Up to K = `iters` iterations of one rollout set (fewer when `minutes` > 0 runs out first): per-iteration
    statistics and the Gram matrix of every arm's gradients, grown one iteration at a time. `extra`: more overrides
    (tests use a small batch); `on_partial(result)` is called every 10 iterations with the result so far."""
    spec = SETS[set_name]
    base = [*COMMON, f"run.threads={threads}", *spec["overrides"], *extra]
    arms = build_arms(set_name, spec, base, arms_only)
    n_a = len(arms)
    torch.set_num_threads(threads)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tr, loaded = make_trainer(spec, base, weights, Path(d))
        B = tr.shard.global_batch
        P = sum(p.numel() for p in tr.trainable)
        X = torch.empty(iters * n_a, P)  # rows: iteration-major, arm-minor (pages are touched as rows are filled)
        gram = torch.zeros(0, 0, dtype=torch.float64)
        per_iter: list[dict[str, Any]] = []

        def result() -> dict[str, Any]:
            k = len(per_iter)
            return {
                "set": set_name, "preset": spec["preset"], "overrides": base, "weights": loaded,
                "arms": [a.name for a in arms], "arm_overrides": {a.name: spec["arms"][a.name] for a in arms},
                "B": B, "K": k, "P": P, "seconds": time.perf_counter() - t_start,
                "gram": gram.view(k, n_a, k, n_a).tolist(), "per_iteration": per_iter,
            }

        for i in range(iters):
            t0 = time.perf_counter()
            out = arm_gradients(tr, arms, first_iter + i, check_zero=check_zero and i == 0)
            X[i * n_a : (i + 1) * n_a] = torch.stack(out.grads)
            gram = grow_gram(gram, X, (i + 1) * n_a)
            wall = time.perf_counter() - t0
            per_iter.append({"iteration": first_iter + i, **out.stats, "arms": out.arm_stats, "wall_s": wall})
            progress(f"{set_name}: iteration {i + 1}/{iters} ({wall:.1f} s)")
            if on_partial is not None and (i + 1) % 10 == 0:
                on_partial(result())
            if minutes > 0 and time.perf_counter() - t_start + wall > 60 * minutes:
                progress(f"{set_name}: {minutes} minutes used, K = {i + 1}")
                break
        return result()


def grow_gram(gram: torch.Tensor, X: torch.Tensor, N: int, block: int = 1 << 16) -> torch.Tensor:
    """The (N, N) float64 Gram matrix of X[:N] (X: (≥ N, P) fp32) from `gram`, that of its first rows: only the new
    rows' dot products are computed (fp32 products summed over column blocks in float64)."""
    n0 = gram.shape[0]
    cross = torch.zeros(N - n0, N, dtype=torch.float64)
    for c in range(0, X.shape[1], block):
        cross += (X[n0:N, c : c + block] @ X[:N, c : c + block].T).double()
    out = torch.zeros(N, N, dtype=torch.float64)
    out[:n0, :n0] = gram
    out[n0:, :] = cross
    out[:, n0:] = cross.T
    return out


# ------------------------------------------------------------------------------------------------------ statistics
def cross_mean(C: np.ndarray, w: np.ndarray) -> float:
    """mean_{i≠j} C[i, j] with iteration weights w (K,) (bootstrap counts; 1 = the sample itself): pairs of copies of
    one iteration are left out, so the noise of an iteration never meets itself."""
    den = w.sum() ** 2 - (w * w).sum()
    return float((w @ C @ w - (w * w * np.diag(C)).sum()) / den) if den > 0 else float("nan")


def arm_stats(C: np.ndarray, B: int, w: np.ndarray | None = None) -> dict[str, float]:
    """ρ, B_noise, cos_rest and the mean |g|² of one arm from its (K, K) Gram matrix C (w: iteration weights)."""
    K = C.shape[0]
    w = np.ones(K) if w is None else np.asarray(w, dtype=float)
    d = np.diag(C)
    sq = float((w * d).sum() / w.sum())
    cross = cross_mean(C, w)
    rho = cross / sq if sq > 0 else float("nan")
    Cw = C @ w
    dot_rest = Cw - w * d  # <g_i, Σ_{j≠i} w_j g_j>
    rest2 = w @ C @ w - 2 * w * Cw + w * w * d  # |Σ_{j≠i} w_j g_j|²
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = dot_rest / np.sqrt(d * np.clip(rest2, 0, None))
    keep = (w > 0) & np.isfinite(cos)
    return {
        "rho": rho,
        "B_noise": B * (1 / rho - 1) if rho > 0 else float("inf"),
        "cos_rest": float((w[keep] * cos[keep]).sum() / w[keep].sum()) if keep.any() else float("nan"),
        "g2": sq,
        "signal2": cross,
    }


def signal_cosine(Cab: np.ndarray, Caa: np.ndarray, Cbb: np.ndarray, w: np.ndarray | None = None) -> float:
    """cos(s_a, s_b) ≈ C_ab / sqrt(C_aa·C_bb), each mean_{i≠j} (NaN when a signal estimate is ≤ 0)."""
    w = np.ones(Cab.shape[0]) if w is None else w
    ab, aa, bb = cross_mean(Cab, w), cross_mean(Caa, w), cross_mean(Cbb, w)
    return ab / math.sqrt(aa * bb) if aa > 0 and bb > 0 else float("nan")


def rho_along(Cab: np.ndarray, Caa: np.ndarray, Cbb: np.ndarray, w: np.ndarray | None = None) -> float:
    """The fraction of arm a's gradient energy that lies along arm b's signal: sign·<s_a, ŝ_b>² / E|g_a|², with
    <s_a, s_b> ≈ C_ab and |s_b|² ≈ C_bb (mean_{i≠j}); = ρ_a · cos²(s_a, s_b). With b the sample-level credit (whose
    expected update is the objective's own direction) it is the part of ρ that serves that direction: the
    useful signal of a step-level credit whose expected gradient points elsewhere (NaN when C_bb ≤ 0)."""
    w = np.ones(Cab.shape[0]) if w is None else w
    ab, bb = cross_mean(Cab, w), cross_mean(Cbb, w)
    sq = float((w * np.diag(Caa)).sum() / w.sum())
    return math.copysign(ab * ab / (bb * sq), ab) if bb > 0 and sq > 0 else float("nan")


def mean_cosine(Cab: np.ndarray, Caa: np.ndarray, Cbb: np.ndarray, w: np.ndarray | None = None) -> float:
    """cos of the arms' mean gradients (their shared same-iteration noise included)."""
    w = np.ones(Cab.shape[0]) if w is None else w
    return float(w @ Cab @ w / math.sqrt((w @ Caa @ w) * (w @ Cbb @ w)))


def _ci(x: Sequence[float], level: float = 0.95) -> list[float]:
    a = np.asarray(x, dtype=float)
    a = a[np.isfinite(a)] if np.isfinite(a).any() else a
    lo, hi = np.percentile(a, [50 * (1 - level), 50 * (1 + level)]) if a.size else (float("nan"),) * 2
    return [float(lo), float(hi)]


def summarize(res: dict[str, Any], n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Point estimates and paired percentile-bootstrap 95% intervals of every arm's statistics, ratios to the first
    arm, signal cosines between arms, NFEs per sample and B_noise × NFE."""
    gram = np.asarray(res["gram"], dtype=float)  # (K, n_a, K, n_a)
    K, n_a = gram.shape[0], gram.shape[1]
    B = res["B"]

    def blk(a: int, b: int) -> np.ndarray:
        return gram[:, a, :, b]

    def stats_at(w: np.ndarray) -> dict[str, np.ndarray]:
        st = [arm_stats(blk(a, a), B, w) for a in range(n_a)]
        rho = np.array([s["rho"] for s in st])
        return {
            "rho": rho, "B_noise": np.array([s["B_noise"] for s in st]),
            "cos_rest": np.array([s["cos_rest"] for s in st]),
            "ratio": rho / rho[0],
            "diff": rho - rho[0],  # paired: the arms' shared noise partly cancels (better conditioned than the ratio)
            "cos_sig": np.array([signal_cosine(blk(a, 0), blk(a, a), blk(0, 0), w) for a in range(n_a)]),
            "cos_mean": np.array([mean_cosine(blk(a, 0), blk(a, a), blk(0, 0), w) for a in range(n_a)]),
            "rho_along_ref": np.array([rho_along(blk(a, 0), blk(a, a), blk(0, 0), w) for a in range(n_a)]),
        }

    point = stats_at(np.ones(K))
    rng = np.random.default_rng(seed)
    boots = [stats_at(rng.multinomial(K, np.full(K, 1 / K)).astype(float)) for _ in range(n_boot)]
    nfe = np.array([[it["arms"][a]["nfe_per_sample"] for a in range(n_a)] for it in res["per_iteration"]]).mean(0)
    calls = np.array([[1 + it["arms"][a]["est_reward_calls"] for a in range(n_a)]
                      for it in res["per_iteration"]]).mean(0)
    arms = []
    for a, name in enumerate(res["arms"]):
        row: dict[str, Any] = {"arm": name, "nfe_per_sample": float(nfe[a]),
                               "reward_calls_per_sample": float(calls[a])}
        for key in point:
            row[key] = float(point[key][a])
            row[f"{key}_ci"] = _ci([b[key][a] for b in boots])
        along = [b["rho_along_ref"][a] for b in boots]
        row["B_along_x_nfe"] = float(B * (1 / row["rho_along_ref"] - 1) * nfe[a]) if row["rho_along_ref"] > 0 else None
        row["B_along_x_nfe_ci"] = _ci([B * (1 / x - 1) * nfe[a] if x > 0 else float("inf") for x in along])
        bn = [b["B_noise"][a] * nfe[a] for b in boots]
        row["B_noise_x_nfe"] = float(point["B_noise"][a] * nfe[a])
        row["B_noise_x_nfe_ci"] = _ci(bn)
        row["p_diff_above_0"] = float(np.mean([b["diff"][a] > 0 for b in boots])) if a > 0 else None
        r, (lo, hi) = row["ratio"], row["ratio_ci"]
        row["ratio_within_2x"] = bool(r > 0 and lo >= r / 2 and hi <= 2 * r) if a > 0 else None
        if a > 0 and r > 0 and lo > 0:
            spread = max(math.log(hi / r), math.log(r / lo))
            row["K_for_2x"] = int(math.ceil(K * (spread / math.log(2)) ** 2))  # CI half-width ∝ 1/√K
        else:
            row["K_for_2x"] = None
        arms.append(row)
    sig = np.full((n_a, n_a), np.nan)
    for a in range(n_a):
        for b in range(n_a):
            sig[a, b] = signal_cosine(blk(a, b), blk(a, a), blk(b, b))
    return {"set": res["set"], "K": K, "B": B, "arms": arms, "signal_cosine_matrix": sig.tolist(), "n_boot": n_boot}


def _fmt(x: float, ci: Sequence[float], spec: str = ".3f") -> str:
    return f"{x:{spec}} [{ci[0]:{spec}}, {ci[1]:{spec}}]"


def _big(x: float | None) -> str:
    return "∞" if x is None or not math.isfinite(x) else f"{x:.3g}"


def print_table(summ: dict[str, Any], file=sys.stdout) -> None:
    """The set's two Markdown tables (signal; compute and direction) and the signal-cosine matrix."""
    ref = summ["arms"][0]["arm"]
    print(f"\n### {summ['set']}: K = {summ['K']} iterations × B = {summ['B']} samples (95% paired bootstrap "
          f"intervals, {summ['n_boot']} resamples; reference arm {ref})\n", file=file)
    print("| arm | ρ | ρ − ρ_ref | P(ρ > ρ_ref) | ρ / ρ_ref | within 2× | K for 2× | cos_rest |", file=file)
    print("|---|---|---|---|---|---|---|---|", file=file)
    for r in summ["arms"]:
        within = "–" if r["ratio_within_2x"] is None else ("yes" if r["ratio_within_2x"] else "no")
        p = "–" if r["p_diff_above_0"] is None else f"{r['p_diff_above_0']:.2f}"
        print(f"| {r['arm']} | {_fmt(r['rho'], r['rho_ci'], '.4f')} | {_fmt(r['diff'], r['diff_ci'], '+.4f')} | {p} "
              f"| {_fmt(r['ratio'], r['ratio_ci'], '.2f')} | {within} | {r['K_for_2x'] or '–'} "
              f"| {_fmt(r['cos_rest'], r['cos_rest_ci'], '.3f')} |", file=file)
    print("\n| arm | NFE / sample | B_noise | B_noise × NFE | cos(s, s_ref) | ρ along s_ref | B along s_ref × NFE |",
          file=file)
    print("|---|---|---|---|---|---|---|", file=file)
    for r in summ["arms"]:
        bn = f"{_big(r['B_noise'])} [{_big(r['B_noise_ci'][0])}, {_big(r['B_noise_ci'][1])}]"
        bx = f"{_big(r['B_noise_x_nfe'])} [{_big(r['B_noise_x_nfe_ci'][0])}, {_big(r['B_noise_x_nfe_ci'][1])}]"
        ba = f"{_big(r['B_along_x_nfe'])} [{_big(r['B_along_x_nfe_ci'][0])}, {_big(r['B_along_x_nfe_ci'][1])}]"
        print(f"| {r['arm']} | {r['nfe_per_sample']:.1f} | {bn} | {bx} | {_fmt(r['cos_sig'], r['cos_sig_ci'], '.2f')} "
              f"| {_fmt(r['rho_along_ref'], r['rho_along_ref_ci'], '.4f')} | {ba} |", file=file)
    names = [r["arm"] for r in summ["arms"]]
    print("\nSignal cosines between arms, C_ab / √(C_aa·C_bb):\n", file=file)
    print("| | " + " | ".join(names) + " |", file=file)
    print("|---" * (len(names) + 1) + "|", file=file)
    for n, row in zip(names, summ["signal_cosine_matrix"]):
        print(f"| {n} | " + " | ".join(f"{v:.2f}" for v in row) + " |", file=file)


# ---------------------------------------------------------------------------------------------------------- main
def parse_arms(arms: Sequence[str] | None) -> dict[str, list[str] | None]:
    """--arms SET or SET/ARM ... → {set: None (all its arms) or [arm, ...]} (a set's reference arm is always in)."""
    if not arms:
        return dict.fromkeys(SETS)
    out: dict[str, list[str] | None] = {}
    for a in arms:
        s, _, arm = a.partition("/")
        if s not in SETS or (arm and arm not in SETS[s]["arms"]):
            raise SystemExit(f"--arms {a}: unknown; sets {list(SETS)}, arms e.g. grpo/{list(SETS['grpo']['arms'])[1]}")
        if not arm:
            out[s] = None
        elif out.get(s, []) is not None:
            out.setdefault(s, []).append(arm)  # type: ignore[union-attr]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=40, help="K: independent iterations per rollout set")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weights", default="shipped", help="shipped, or a checkpoint / run folder")
    ap.add_argument("--arms", nargs="*", help="SET or SET/ARM (sets: " + ", ".join(SETS) + "); default all")
    ap.add_argument("--out", type=Path, help="folder for gradient_signal.json and table.md")
    ap.add_argument("--minutes", type=float, default=0.0, help="per set: stop before K when this time is used")
    ap.add_argument("--first-iter", type=int, default=1, help="the first iteration's index (its prompts and noise)")
    ap.add_argument("--boot", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--from-json", type=Path, help="print the table of a saved gradient_signal.json (no compute)")
    a = ap.parse_args(argv)
    if a.from_json:
        doc = json.loads(a.from_json.read_text())
        for res in doc["sets"]:
            print_table(summarize(res, a.boot))
        return
    if a.out is None:
        ap.error("--out is required (unless --from-json)")
    a.out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"argv": sys.argv[1:] if argv is None else list(argv), "weights": a.weights, "sets": []}
    path = a.out / "gradient_signal.json"
    for set_name, only in parse_arms(a.arms).items():
        def partial(res: dict[str, Any], done: list = doc["sets"]) -> None:  # a stopped run keeps what it measured
            path.write_text(json.dumps({**doc, "sets": [*done, res]}))

        res = run_set(set_name, only, a.iters, a.threads, a.weights, a.first_iter, minutes=a.minutes,
                      progress=lambda m: print(m, file=sys.stderr, flush=True), on_partial=partial)
        doc["sets"].append(res)
        path.write_text(json.dumps(doc))  # after every set: a partial run keeps what it measured
    with open(a.out / "table.md", "w") as f:
        for res in doc["sets"]:
            summ = summarize(res, a.boot)
            res["summary"] = summ
            print_table(summ)
            print_table(summ, file=f)
    path.write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
