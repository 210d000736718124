"""benchmarks/gradient_signal.py measures the trainer's own update gradient, and its statistics are right by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

BENCHMARK = "gradient_signal"  # benchmarks/gradient_signal.py, the `bench` fixture (conftest.py)

# a small batch and fp32, so the comparison with the trainer is tight and the test fast
SMALL = ["data.prompts_per_iter=2", "data.group_size=4", "model.precision=fp32", "optim.grad_clip=1e9",
         "run.threads=1"]


# ------------------------------------------------------------------------------------------------- hand values
def test_rho_b_noise_and_cos_rest_of_three_hand_gradients(bench):
    # g1 = (1, 0), g2 = (0, 1), g3 = (1, 1): mean |g|² = 4/3; mean_{i≠j} <g_i, g_j> = (2·(0 + 1 + 1)) / 6 = 2/3
    C = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 1.0, 2.0]])
    st = bench.arm_stats(C, B=8)
    assert st["rho"] == pytest.approx(0.5)
    assert st["B_noise"] == pytest.approx(8.0)  # 8·(1/0.5 − 1)
    # cos(g1, g2+g3) = 1/√5, cos(g2, g1+g3) = 1/√5, cos(g3, g1+g2) = 1
    assert st["cos_rest"] == pytest.approx((2 / math.sqrt(5) + 1) / 3)


def test_a_resampled_iteration_is_never_paired_with_its_copy(bench):
    C = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 1.0, 2.0]])
    # weights (2, 1, 0): pairs (g1, g2) ×4 only, <g1, g2> = 0; the copies of g1 (<g1, g1> = 1) are left out
    assert bench.cross_mean(C, np.array([2.0, 1.0, 0.0])) == 0.0
    assert bench.cross_mean(C, np.array([1.0, 0.0, 1.0])) == 1.0  # <g1, g3>


def test_an_arm_that_is_twice_another_has_signal_cosine_one_and_ratio_one(bench):
    C = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 1.0, 2.0]])  # arm a; arm b = 2·a
    assert bench.signal_cosine(2 * C, C, 4 * C) == pytest.approx(1.0)
    assert bench.arm_stats(4 * C, 8)["rho"] == pytest.approx(bench.arm_stats(C, 8)["rho"])


def test_the_gram_matrix_grows_one_iteration_at_a_time(bench):
    X = torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, 3.0], [2.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    g = bench.grow_gram(torch.zeros(0, 0, dtype=torch.float64), X, 2)
    g = bench.grow_gram(g, X, 4)
    assert torch.equal(g, torch.tensor([[5.0, 2, 2, 3], [2, 10, 3, 4], [2, 3, 5, 3], [3, 4, 3, 3]], dtype=torch.float64))


# ----------------------------------------------------------------------------- the trainer's gradient, exactly
def _trainer_gradients(cfg, steps: int = 1) -> list[torch.Tensor]:
    """The gradients `Trainer.train_step` applies in its first `steps` iterations (captured instead of the optimizer
    step, so the weights stay where they are, as in the benchmark)."""
    import tempfile
    from pathlib import Path

    from flowcredit.trainer.loop import Trainer

    with tempfile.TemporaryDirectory() as d:
        cfg.run.out_dir = str(Path(d) / "run")
        tr = Trainer(cfg, "test")
        tr.setup()
        captured = []
        tr.opt.step = lambda *a, **k: captured.append(
            torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float()
                       for p in tr.trainable]))
        for i in range(steps):
            if i:
                tr.opt.zero_grad(set_to_none=True)
                tr.iteration += 1  # as Trainer.train does between steps
            tr.train_step()
        tr.close()
    assert len(captured) == steps
    return captured


def _trainer_gradient(bench, cfg) -> torch.Tensor:
    """The gradient `Trainer.train_step` applies in its first optimizer step (captured before the step)."""
    return _trainer_gradients(cfg)[0]


@pytest.mark.parametrize("set_name, arm", [("nft", "stepwise_t1_per_step"), ("grpo", "stepwise_t1_joint")])
def test_every_arm_gets_the_gradient_the_trainer_applies(bench, tmp_path, set_name, arm):
    spec = bench.SETS[set_name]
    base = [*bench.COMMON, *spec["overrides"], *SMALL]
    arms = bench.build_arms(set_name, spec, base, [arm])
    tr, _ = bench.make_trainer(spec, base, "shipped", tmp_path)
    out = bench.arm_gradients(tr, arms, 1, check_zero=True)
    tr.close()
    assert out.stats["g0_max_abs"] == 0.0  # an A = 0 pair has exactly zero gradient (affine in A, zero at 0)
    for a, g in zip(arms, out.grads):
        want = _trainer_gradient(bench, bench.load_cfg(spec["preset"], [*base, *spec["arms"][a.name]]))
        assert float(want.norm()) > 0
        assert torch.allclose(g, want, rtol=1e-4, atol=1e-5 * float(want.abs().max())), a.name
    # the arms differ (their credit does), on the same rollouts
    assert not torch.allclose(out.grads[0], out.grads[1])


def test_rho_along_the_reference_counts_only_the_reference_direction(bench):
    ref = np.array([[1.0, 0.0]] * 3)  # s_ref = (1, 0), no noise
    a = np.array([[1.0, 1.0], [1.0, -1.0], [1.0, 1.0]])  # along s_ref: 1 per iteration; E|g_a|² = 2
    blk = lambda x, y: x @ y.T  # noqa: E731
    assert bench.rho_along(blk(a, ref), blk(a, a), blk(ref, ref)) == pytest.approx(0.5)  # 1² / (1 · 2)
    assert bench.rho_along(blk(-a, ref), blk(a, a), blk(ref, ref)) == pytest.approx(-0.5)  # against it: negative


def test_an_ema_arm_carries_its_baseline_to_the_next_iteration_as_the_trainer_does(bench, tmp_path):
    """The EMA baseline (Stepwise App. A.1) is credit state: the benchmark's second iteration must use the baseline
    the first one left, exactly as two `Trainer.train_step`s do."""
    from flowcredit.credit.stepwise import EMA_STATE_KEY

    spec = bench.SETS["stepwise_variants"]
    base = [*bench.COMMON, *spec["overrides"], *SMALL, "estimate.substeps=2"]
    arms = bench.build_arms("stepwise_variants", spec, base, ["stepwise_t5_ema"])
    arms = [a for a in arms if a.name == "stepwise_t5_ema"]
    for a in arms:  # T′ = 2 keeps the test fast; the state logic does not depend on T′
        a.cfg.estimate.substeps = 2
    tr, _ = bench.make_trainer(spec, base, "shipped", tmp_path)
    tr.opt.zero_grad(set_to_none=True)
    bench.arm_gradients(tr, arms, 1)
    first = arms[0].credit_state[EMA_STATE_KEY].clone()
    second_grad = bench.arm_gradients(tr, arms, 2).grads[0]
    tr.close()
    assert not torch.equal(arms[0].credit_state[EMA_STATE_KEY], first)  # updated again by iteration 2

    cfg = bench.load_cfg(spec["preset"], [*base, *spec["arms"]["stepwise_t5_ema"]])
    cfg.estimate.substeps = 2
    want = _trainer_gradients(cfg, steps=2)[1]
    assert torch.allclose(second_grad, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
