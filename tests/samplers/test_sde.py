"""Sampler steps, Gaussian log-probs and KL (ALGORITHMS.md §2)."""

import math

import pytest
import torch

from flowcredit.samplers.schedules import time_grid
from flowcredit.samplers.sde import (
    SAMPLERS,
    SamplerParams,
    expand_like,
    flow_grpo_std_dev,
    gaussian_kl_same_std,
    gaussian_log_prob,
    noise_level,
    sampler_step,
)

LATENT = (3, 4, 4)

# Every stochastic configuration, including the ddim_sde ablation flags.
STOCHASTIC = [
    SamplerParams("flow_sde"),
    SamplerParams("cps"),
    SamplerParams("ddim_sde"),
    SamplerParams("ddim_sde", options={"sigma": "eta_s"}),
    SamplerParams("ddim_sde", options={"coef": "mm"}),
]


def _inputs(batch=4, latent=LATENT, t=0.8, t_next=0.6):
    x = torch.randn(batch, *latent)
    v = torch.randn(batch, *latent)
    return x, v, torch.full((batch,), t), torch.full((batch,), t_next)


@pytest.mark.parametrize("params", STOCHASTIC, ids=lambda p: f"{p.name}-{p.options}")
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_log_prob_equals_torch_normal(params, reduce):
    params = SamplerParams(params.name, reduce=reduce, options=params.options)
    x, v, t, t_next = _inputs()
    out = sampler_step(params, x, v, t, t_next, generator=torch.Generator().manual_seed(0))
    assert bool((out.std > 0).all())
    ref = torch.distributions.Normal(out.mean, expand_like(out.std, out.mean)).log_prob(out.x_next)
    ref = ref.mean(dim=(1, 2, 3)) if reduce == "mean" else ref.sum(dim=(1, 2, 3))
    assert torch.allclose(out.log_prob, ref, atol=1e-5, rtol=1e-5)


def test_gaussian_log_prob_zero_std_rows_are_zero_not_nan():
    x, mean = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    std = torch.tensor([0.0, 0.5, 0.0])
    lp = gaussian_log_prob(x, mean, std, "sum")
    assert lp[0] == 0 and lp[2] == 0 and torch.isfinite(lp).all()
    assert torch.allclose(lp[1], torch.distributions.Normal(mean[1], 0.5).log_prob(x[1]).sum())


def test_ode_is_euler_step():
    x, v, t, t_next = _inputs()
    out = sampler_step(SamplerParams("ode"), x, v, t, t_next)
    assert torch.equal(out.x_next, x + (t_next - t)[:, None, None, None] * v)
    assert torch.equal(out.mean, out.x_next)
    assert not out.std.any() and not out.log_prob.any() and not out.kl_std.any()


@pytest.mark.parametrize(
    "params",
    [
        SamplerParams("flow_sde", noise_level=0.0),
        SamplerParams("cps", noise_level=0.0),
        SamplerParams("ddim_sde", noise_level=0.0),
        SamplerParams("ddim_sde", noise_level=0.0, options={"sigma": "eta_s"}),
        SamplerParams("ddim_sde", noise_level=0.0, options={"coef": "mm"}),
    ],
    ids=["flow_sde", "cps", "ddim_sqrt", "ddim_eta_s", "ddim_mm"],
)
@pytest.mark.parametrize("times", [(1.0, 0.96), (0.8, 0.6), (0.05, 0.0)])
def test_zero_noise_reproduces_ode(params, times):
    x, v, t, t_next = _inputs(t=times[0], t_next=times[1])
    euler = x + (t_next - t)[:, None, None, None] * v
    out = sampler_step(params, x, v, t, t_next, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(out.x_next, euler, atol=1e-6)
    assert not out.std.any() and not out.log_prob.any()


@pytest.mark.parametrize("params", STOCHASTIC, ids=lambda p: f"{p.name}-{p.options}")
def test_scoring_recorded_sample_reproduces_log_prob(params):
    x, v, t, t_next = _inputs()
    noise = torch.randn(x.shape)
    sampled = sampler_step(params, x, v, t, t_next, noise=noise)
    assert torch.allclose(sampled.x_next, sampled.mean + expand_like(sampled.std, x) * noise)
    scored = sampler_step(params, x, v, t, t_next, x_next=sampled.x_next)
    assert torch.equal(scored.log_prob, sampled.log_prob)
    assert torch.equal(scored.x_next, sampled.x_next)


def test_generator_makes_sampling_reproducible():
    x, v, t, t_next = _inputs()
    params = SamplerParams("flow_sde")
    a = sampler_step(params, x, v, t, t_next, generator=torch.Generator().manual_seed(3)).x_next
    b = sampler_step(params, x, v, t, t_next, generator=torch.Generator().manual_seed(3)).x_next
    assert torch.equal(a, b)


def test_zero_dim_times_broadcast():
    x, v, t, t_next = _inputs()
    params = SamplerParams("ddim_sde")
    noise = torch.randn(x.shape)
    a = sampler_step(params, x, v, t, t_next, noise=noise)
    b = sampler_step(params, x, v, torch.tensor(0.8), torch.tensor(0.6), noise=noise)
    assert torch.equal(a.x_next, b.x_next) and torch.equal(a.log_prob, b.log_prob)


@pytest.mark.parametrize("latent", [(7,), (16, 8), (2, 3, 4, 4)], ids=["vector", "tokens", "video"])
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_shape_generic_and_bf16_inputs_give_fp32(latent, name):
    x, v, t, t_next = _inputs(batch=2, latent=latent)
    out = sampler_step(SamplerParams(name), x.bfloat16(), v.bfloat16(), t, t_next, generator=torch.Generator())
    assert out.x_next.shape == (2, *latent) and out.x_next.dtype == torch.float32
    assert out.log_prob.shape == (2,) and out.log_prob.dtype == torch.float32
    assert out.std.shape == (2,) and out.kl_std.shape == (2,)


def test_flow_sde_t1_guard_is_finite_and_matches_code_form():
    # At t = 1 the denominator 1 − t uses t* = t_next (flow_grpo's sigmas[1]); the numerator keeps t = 1.
    t, t_next = torch.tensor([1.0]), torch.tensor([0.96])
    std_dev = flow_grpo_std_dev(t, t_next, 0.7)
    assert torch.isfinite(std_dev).all()
    assert torch.allclose(std_dev, torch.tensor([0.7 * math.sqrt(1.0 / 0.04)]))
    # Degenerate grid t = t_next = 1 still finite (named floor constant).
    assert torch.isfinite(flow_grpo_std_dev(torch.tensor([1.0]), torch.tensor([1.0]), 0.7)).all()


@pytest.mark.parametrize("name", sorted(SAMPLERS))
@pytest.mark.parametrize("times", [(1.0, 0.9601), (0.0089, 0.0), (0.0, 0.0)], ids=["first", "last", "t0"])
def test_grid_ends_give_finite_samples(name, times):
    x, v, t, t_next = _inputs(t=times[0], t_next=times[1])
    out = sampler_step(SamplerParams(name), x, v, t, t_next, generator=torch.Generator().manual_seed(0))
    for value in (out.x_next, out.mean, out.std, out.log_prob, out.kl_std):
        assert torch.isfinite(value).all()


def test_per_step_stds_match_algorithms_table():
    # ALGORITHMS.md §1.4 table (a = 0.7 for flow_sde / cps; DDIM column is σ/η = (t−Δt)·√(1−t)), values rounded.
    flow = [0.700, 0.743, 0.536, 0.446, 0.392, 0.353, 0.319, 0.282, 0.225, 0.006]
    cps = [0.855, 0.814, 0.764, 0.704, 0.630, 0.537, 0.414, 0.248, 0.008, 0.000]
    ddim_over_eta = [None, 0.182, 0.252, 0.298, 0.324, 0.326, 0.293, 0.203, 0.008, 0.000]
    grid = time_grid(10, 3.0, "diffusers")
    x, v = torch.zeros(1, 2), torch.zeros(1, 2)
    for step in range(10):
        t, t_next = grid[step : step + 1], grid[step + 1 : step + 2]
        assert abs(sampler_step(SamplerParams("flow_sde"), x, v, t, t_next).std.item() - flow[step]) < 3e-3
        assert abs(sampler_step(SamplerParams("cps"), x, v, t, t_next).std.item() - cps[step]) < 3e-3
        ddim = sampler_step(SamplerParams("ddim_sde", noise_level=1.0), x, v, t, t_next).std.item()
        if ddim_over_eta[step] is not None:
            assert abs(ddim - ddim_over_eta[step]) < 3e-3
        else:
            # Step 0: the √(1−t) factor is taken at t_next, so step 0 explores (decisions table, A3).
            assert abs(ddim - 0.9601 * math.sqrt(1 - 0.9601)) < 3e-3 and ddim > 0


def test_ddim_coefficients_agree_to_second_order():
    # c_DDIM = sqrt(s² − σ²) and c_MM = s − σ²/(2s) differ by O(σ⁴) (ALGORITHMS.md §2.3 (c)).
    x, v, t, t_next = _inputs(t=0.8, t_next=0.7)
    noise = torch.randn(x.shape)
    for eta, tol in ((0.1, 1e-5), (0.3, 1e-3)):
        a = sampler_step(SamplerParams("ddim_sde", noise_level=eta), x, v, t, t_next, noise=noise)
        b = sampler_step(SamplerParams("ddim_sde", noise_level=eta, options={"coef": "mm"}), x, v, t, t_next, noise=noise)
        assert torch.allclose(a.mean, b.mean, atol=tol) and not torch.equal(a.mean, b.mean)


def test_misuse_raises_teaching_errors():
    x, v, t, t_next = _inputs()
    with pytest.raises(ValueError, match="not both"):
        sampler_step(SamplerParams("flow_sde"), x, v, t, t_next, noise=torch.randn(x.shape), x_next=x)
    with pytest.raises(ValueError, match="not a registered sampler; use one of ode, flow_sde, cps, ddim_sde"):
        SamplerParams("euler_maruyama")
    with pytest.raises(ValueError, match="unknown key 'sampler.options.sigma'.*the options of sampler 'flow_sde'"):
        SamplerParams("flow_sde", options={"sigma": "eta_s"})
    with pytest.raises(ValueError, match="reduce"):
        SamplerParams("cps", reduce="max")
    with pytest.raises(ValueError, match=r"\(B,\)"):
        sampler_step(SamplerParams("cps"), x, v, torch.ones(3), t_next)
    with pytest.raises(ValueError, match="noise"):
        sampler_step(SamplerParams("cps"), x, v, t, t_next, noise=torch.randn(1, 2))


def test_default_noise_levels():
    assert noise_level(SamplerParams("flow_sde")) == 0.7
    assert noise_level(SamplerParams("cps")) == 0.7
    assert noise_level(SamplerParams("ddim_sde")) == 0.9
    assert noise_level(SamplerParams("ddim_sde", noise_level=0.5)) == 0.5
    assert SamplerParams("flow_sde").noise_level is None  # the config keeps null: the default is the sampler's


def test_kl_same_std():
    mean, std = torch.randn(3, 2, 4), torch.tensor([0.5, 1.0, 0.0])
    assert not gaussian_kl_same_std(mean, mean.clone(), std).any()
    mean_ref = mean + 0.1
    # every dim differs by 0.1: per-dim KL = 0.01 / (2·std²) -> row 0: 0.02, row 1: 0.005, row 2 (std 0): 0
    kl = gaussian_kl_same_std(mean, mean_ref, std, "mean")
    assert torch.allclose(kl, torch.tensor([0.02, 0.005, 0.0]), atol=1e-6)
    assert torch.allclose(gaussian_kl_same_std(mean, mean_ref, std, "sum"), kl * 8, atol=1e-6)
    # Equals KL of torch distributions for a stochastic row.
    p = torch.distributions.Normal(mean[0], 0.5)
    q = torch.distributions.Normal(mean_ref[0], 0.5)
    assert torch.allclose(kl[0], torch.distributions.kl_divergence(p, q).mean(), atol=1e-6)


# ---------------------------------------------------------------------------------- closed-form Gaussian flow

DATA_MEAN, DATA_STD = 1.5, 0.5


def gaussian_velocity(x, t):
    """Exact flow velocity for data x0 ~ N(m, s²), noise x1 ~ N(0, 1), x_t = (1−t)·x0 + t·x1 (1-D).

    E[x_t] = (1−t)·m, Var x_t = V = (1−t)²·s² + t²; v = x1 − x0 has E[v] = −m and
    Cov(v, x_t) = t·Var x1 − (1−t)·Var x0 = t − (1−t)·s², so the Gaussian conditional mean is
    E[v | x_t] = −m + (t − (1−t)·s²)/V · (x_t − (1−t)·m).
    """
    t = t.reshape(-1, 1)
    var = (1 - t) ** 2 * DATA_STD**2 + t**2
    return -DATA_MEAN + (t - (1 - t) * DATA_STD**2) / var * (x - (1 - t) * DATA_MEAN)


@pytest.mark.parametrize("name", ["ode", "flow_sde"])
def test_gaussian_data_terminal_moments(name):
    # 8k samples: MC std error of the mean ≈ 0.5/√8000 ≈ 0.0056, of the variance ≈ 0.25·√(2/8000) ≈ 0.004.
    # 200 Euler steps keep the discretisation bias ≲ 0.006. flow_sde is marginal preserving in the continuous limit
    # (cps / ddim_sde are not: their per-step noise does not shrink with Δt, so they are not checked here).
    generator = torch.Generator().manual_seed(0)
    num, steps = 8000, 200
    x = torch.randn(num, 1, generator=generator)
    grid = time_grid(steps, shift=1.0)
    params = SamplerParams(name, noise_level=0.7 if name == "flow_sde" else None)
    for step in range(steps):
        t, t_next = grid[step].expand(num), grid[step + 1].expand(num)
        x = sampler_step(params, x, gaussian_velocity(x, t), t, t_next, generator=generator).x_next
    assert abs(x.mean().item() - DATA_MEAN) < 0.02
    assert abs(x.var().item() - DATA_STD**2) < 0.02
