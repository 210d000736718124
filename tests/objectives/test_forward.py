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


def _kl(fp, policy, ref, iteration=1, micro_batch=B * T):
    """The KL terms of all B·T pairs, computed micro-batch by micro-batch (pairs in (b, j) order)."""
    ctx = _ctx(policy, ref, iteration)
    pairs = [(b, j) for b in range(B) for j in range(T)]
    fp.prepare(ctx, pairs)
    kls, nfe = [], 0
    for s in range(0, len(pairs), micro_batch):
        bi = torch.tensor([p[0] for p in pairs[s : s + micro_batch]])
        ji = torch.tensor([p[1] for p in pairs[s : s + micro_batch]])
        x_t, t, _, _ = fp.noised(ctx, bi, ji)
        v = fp.velocity(ctx, policy, x_t, t, bi)
        kl, n = fp.velocity_kl(ctx, v, x_t, t, bi, ji)
        kls.append(kl)
        nfe += n
    return torch.cat(kls), nfe


def test_kl_fraction_one_is_the_full_term():
    policy, ref = Linear(1.3), Linear(1.0)
    kl, nfe = _kl(ForwardProcess("rollout"), policy, ref)
    assert nfe == B * T and ref.calls == [B * T]
    assert (kl > 0).all()


def test_kl_fraction_computes_a_fixed_size_random_subset_and_is_unbiased():
    policy, ref = Linear(1.3), Linear(1.0)
    full, _ = _kl(ForwardProcess("rollout"), policy, ref)
    f, mb = 0.25, 16  # 4 micro-batches of 16 pairs: 4 reference rows each, weighted 16/4
    est, nfe = _kl(ForwardProcess("rollout", kl_fraction=f), policy, ref, micro_batch=mb)
    kept = est != 0
    assert ref.calls[-4:] == [4, 4, 4, 4] and nfe == 16 and int(kept.sum()) == 16
    assert all(int(kept[s : s + mb].sum()) == 4 for s in range(0, B * T, mb))
    torch.testing.assert_close(est[kept], full[kept] * 4)  # the drawn pairs: their term times n/k
    # the same draw on a resume / another rank (seeded by run seed and iteration), another one next iteration
    assert torch.equal(_kl(ForwardProcess("rollout", kl_fraction=f), policy, ref, micro_batch=mb)[0] != 0, kept)
    assert not torch.equal(_kl(ForwardProcess("rollout", kl_fraction=f), policy, ref, 2, micro_batch=mb)[0] != 0, kept)
    # unbiased: over many updates each pair is drawn with probability k/n = f, so the mean estimate is the full term
    # (noise=rollout: x_t are the rollout states, so the full term is the same in every update)
    runs = [_kl(ForwardProcess("rollout", kl_fraction=f), policy, ref, i, micro_batch=mb)[0] for i in range(400)]
    freq = torch.stack([r != 0 for r in runs]).float().mean(0)
    assert (freq - f).abs().max() < 0.1 and freq.mean().item() == pytest.approx(f, abs=1e-6)
    torch.testing.assert_close(torch.stack(runs).mean(0).sum(), full.sum(), rtol=0.03, atol=0)


def test_kl_fraction_gradient_flows_through_the_drawn_pairs():
    policy, ref = Linear(1.3), Linear(1.0)
    est, _ = _kl(ForwardProcess("rollout", kl_fraction=0.5), policy, ref)
    est.sum().backward()
    assert policy.a.grad is not None and policy.a.grad > 0  # the KL pulls a = 1.3 back toward the reference's 1.0


def _rank_ctx(policy, ref, rows: slice):
    """The context of a rank holding rows `rows` of the B-row batch of `_ctx` (its slice of the same rollout)."""
    full = _ctx(policy, ref)
    tr = full.traj
    traj = Trajectory(latents=tr.latents[rows], log_probs=tr.log_probs[rows], timesteps=tr.timesteps,
                      step_mask=tr.step_mask, group_ids=tr.group_ids[rows], prompts=tr.prompts[rows],
                      metadata=tr.metadata[rows])
    full.traj, full.row_start, full.batch_global = traj, rows.start, B
    return full


@pytest.mark.parametrize("crn", [False, True])
def test_noise_and_kl_subset_do_not_depend_on_the_process_layout(crn):
    """One process with all B rows vs two 'ranks' with B/2 rows each, over the same global step plan: every pair
    gets the same forward noise and the same KL term (subset and weight), whichever rank computes it. The blocks of
    the subset are the one-process micro-batches (6 pairs here), so one process draws per micro-batch as before."""
    policy, ref = Linear(1.3), Linear(1.0)
    g = torch.Generator().manual_seed(3)
    plan = [(int(b), int(j)) for b, j in zip(torch.randint(0, B, (40,), generator=g), torch.randint(0, T, (40,), generator=g))]
    plan = list(dict.fromkeys(plan))  # the step's global pairs, in the plan's order, no repeats
    mb = 6

    def terms(ctx, fp, mine, offset):
        fp.prepare(ctx, mine)
        fp.start_step(ctx, plan)
        out = {}
        for s in range(0, len(mine), mb):
            bi = torch.tensor([p[0] for p in mine[s : s + mb]])
            ji = torch.tensor([p[1] for p in mine[s : s + mb]])
            x_t, t, _, eps = fp.noised(ctx, bi, ji)
            kl, _ = fp.velocity_kl(ctx, fp.velocity(ctx, policy, x_t, t, bi), x_t, t, bi, ji)
            for n, (b, j) in enumerate(zip(bi.tolist(), ji.tolist())):
                out[(b + offset, j)] = (eps[n].clone(), float(kl[n]))
        return out

    one_ctx = _ctx(policy, ref)
    one_ctx.micro_batch = mb
    one = terms(one_ctx, ForwardProcess("fresh", crn=crn, kl_fraction=0.34), plan, 0)
    two = {}
    for rows in (slice(0, B // 2), slice(B // 2, B)):
        ctx = _rank_ctx(policy, ref, rows)
        ctx.micro_batch = mb
        mine = [(b - rows.start, j) for b, j in plan if rows.start <= b < rows.stop]
        two.update(terms(ctx, ForwardProcess("fresh", crn=crn, kl_fraction=0.34), mine, rows.start))
    assert one.keys() == two.keys() == set(plan)
    for p in plan:
        assert torch.equal(one[p][0], two[p][0]), p
        assert one[p][1] == pytest.approx(two[p][1], rel=1e-6, abs=1e-12), p
    n_kl = sum(1 for v in one.values() if v[1] > 0)
    blocks = [min(mb, len(plan) - s) for s in range(0, len(plan), mb)]
    assert n_kl == sum(max(1, round(0.34 * n)) for n in blocks)  # k = round(f·n) per block of n
