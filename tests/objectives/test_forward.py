"""forward: the KL estimate on a fraction of the pairs (kl_fraction) against the full KL term."""

import contextlib

import pytest
import torch

from flowcredit.objectives.base import LossContext
from flowcredit.objectives.forward import ForwardProcess
from flowcredit.types import Trajectory

B, T = 16, 4


class Linear:
    """A toy FlowModel: v = a·x_t + t (a scalar weight), enough to tell policy and reference apart."""

    def __init__(self, a: float):
        self.a = torch.tensor(a, requires_grad=True)
        self.calls: list[int] = []

    def velocity(self, x_t, t, cond):
        self.calls.append(x_t.shape[0])
        return self.a * x_t + t.view(-1, 1, 1, 1)


def _ctx(policy, ref, iteration=1):
    g = torch.Generator().manual_seed(0)
    traj = Trajectory(
        latents=torch.randn(B, T + 1, 2, 2, 2, generator=g), log_probs=torch.zeros(B, T),
        timesteps=torch.linspace(1, 0, T + 1), step_mask=torch.ones(T, dtype=torch.bool),
        group_ids=torch.arange(B) // 4, prompts=[""] * B, metadata=[{}] * B,
    )
    return LossContext(
        model=policy, traj=traj, cond={"ids": torch.zeros(B, 1)}, uncond=None, guidance=1.0, params=None,
        reference=lambda: contextlib.nullcontext(ref), on_policy=True, seed=7, iteration=iteration, kl_beta=0.5,
    )


def _kl(fp, policy, ref, iteration=1):
    ctx = _ctx(policy, ref, iteration)
    pairs = [(b, j) for b in range(B) for j in range(T)]
    fp.prepare(ctx, pairs)
    bi, ji = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    x_t, t, _, _ = fp.noised(ctx, bi, ji)
    v = fp.velocity(ctx, policy, x_t, t, bi)
    kl, nfe = fp.velocity_kl(ctx, v, x_t, t, bi, ji)
    return kl, nfe, fp.kl_keep


def test_kl_fraction_one_is_the_full_term():
    policy, ref = Linear(1.3), Linear(1.0)
    kl, nfe, keep = _kl(ForwardProcess("fresh"), policy, ref)
    assert keep is None and nfe == B * T and ref.calls == [B * T]
    assert (kl > 0).all()


def test_kl_fraction_computes_the_drawn_pairs_only_and_is_unbiased():
    policy, ref = Linear(1.3), Linear(1.0)
    full, _, _ = _kl(ForwardProcess("fresh"), policy, ref)
    f = 0.25
    est, nfe, keep = _kl(ForwardProcess("fresh", kl_fraction=f), policy, ref)
    kept = keep.flatten()
    assert 0 < kept.sum() < B * T and nfe == int(kept.sum()) and ref.calls[-1] == int(kept.sum())
    torch.testing.assert_close(est[kept], full[kept] / f)  # the drawn pairs: their term over f
    assert (est[~kept] == 0).all()
    # the same draw on a resume / another rank (seeded by run seed and iteration), another one next iteration
    assert torch.equal(_kl(ForwardProcess("fresh", kl_fraction=f), policy, ref)[2], keep)
    assert not torch.equal(_kl(ForwardProcess("fresh", kl_fraction=f), policy, ref, iteration=2)[2], keep)
    # unbiased: over many updates each pair is drawn with probability f
    freq = torch.stack([_kl(ForwardProcess("fresh", kl_fraction=f), policy, ref, i)[2].float() for i in range(300)])
    assert freq.mean().item() == pytest.approx(f, abs=0.01)


def test_kl_fraction_gradient_flows_through_the_drawn_pairs():
    policy, ref = Linear(1.3), Linear(1.0)
    est, _, _ = _kl(ForwardProcess("fresh", kl_fraction=0.5), policy, ref)
    est.sum().backward()
    assert policy.a.grad is not None and policy.a.grad > 0  # the KL pulls a = 1.3 back toward the reference's 1.0
