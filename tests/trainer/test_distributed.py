"""Many processes: 2 CPU processes (gloo, torchrun) train exactly like 1 process with the same global batch; the
layout-independent pieces (shard, noise, update plan) in isolation; memory switches (optimizer / reference offload,
gradient checkpointing) are honoured and do not change the result."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_script as ds  # noqa: E402

from flowcredit import checkpoints as checkpoint  # noqa: E402
from flowcredit.trainer.distributed import Shard, layout_noise, plan_update, systematic_steps  # noqa: E402


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


TIMING = ("seconds", "seconds_total")

# ---------------------------------------------------------------------------------------------------------------
# 2 processes == 1 process
# ---------------------------------------------------------------------------------------------------------------

CASES = {
    # global std (flow_grpo) + two optimizer steps per iteration + short micro-batches
    "flow_grpo": ("optim.updates_per_epoch=2", "optim.micro_batch=3"),
    # step rewards gathered, stateful credit (EMA baseline), KL to a frozen reference, EMA weights, shared noise
    "stepwise": ("method=stepwise", "estimate.substeps=2", "optim.kl_beta=0.1", "optim.ema_decay=0.5"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_match_one_process(tmp_path, model_path, case):
    extra = CASES[case]
    one = ds.make_trainer(model_path, tmp_path / "one", *extra)
    one.train()
    ref = one.model.net.state_dict()

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(ds.__file__)), str(model_path), str(tmp_path / "two"), *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, env=ds.child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.time() - t0 < 60

    r0 = torch.load(tmp_path / "two" / "final_rank0.pt")
    r1 = torch.load(tmp_path / "two" / "final_rank1.pt")
    assert r0.keys() == ref.keys()
    for k in ref:
        assert torch.equal(r0[k], r1[k]), f"ranks disagree on {k}"
        torch.testing.assert_close(r0[k], ref[k], rtol=1e-5, atol=1e-5, msg=f"2 processes vs 1: {k}")
    m1, m2 = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["iteration"] for r in m2] == [1, 2]
    for a, b in zip(m1, m2):
        assert a.keys() == b.keys()
        assert a["pairs_trained"] == b["pairs_trained"] and a["reward_calls"] == b["reward_calls"]
        assert a["nfe_update"] == b["nfe_update"] and a["grad_norm"] > 0
        for k in ("reward_mean", "reward_std", "grad_norm", "credit/adv_std"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    # only rank 0 wrote the run folder, and its checkpoint verifies
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["iter000002"]


DEFAULT_JOB_CASES = {"default": ((), 2e-4),  # (extra overrides, their lr)
                     "lora": (("model.trainable=lora", "model.lora_rank=4", "model.lora_alpha=8", "optim.lr=1e-3"), 1e-3)}
ITERS = 4


@pytest.mark.parametrize("case", list(DEFAULT_JOB_CASES))
def test_default_job_on_two_processes_starts_and_ends_with_the_one_process_weights(tmp_path, case):
    """The default job (tiny_nft, shipped model, 8 prompts × 8 samples, shapes reward, KL on a third of the pairs)
    for 4 iterations, and the same with a peft LoRA (whose init draws from the global RNG): both ranks start from
    the one-process weights, bit for bit, and end within 1% of lr × iterations of them.

    Not bit-identical: each rank accumulates its own micro-batches and the gradients are then summed over ranks (the
    same fp32 additions in another order), and AdamW's per-element step m/(√v + ε) turns that rounding of a near-zero
    gradient element into a visible relative change of its step. Measured on a 2-core AVX2 CPU: max |Δ| 1.5e-6
    (default, lr 2e-4: 0.18% of lr × 4) and 3.3e-6 (LoRA, lr 1e-3: 0.08%); a layout-dependent draw (the KL subset
    or the forward noise per rank, fixed in objectives/forward.py) gave 3.5e-4, far outside the tolerance."""
    extra, lr = DEFAULT_JOB_CASES[case]
    one = ds.make_trainer("default", tmp_path / "one", *extra)
    init = {k: v.detach().clone() for k, v in one.model.net.state_dict().items()}
    one.train()
    ref = one.model.net.state_dict()

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(ds.__file__)), "default", str(tmp_path / "two"), *extra]
    proc = subprocess.run(cmd, env=ds.child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    moved = 0.0
    for r in range(2):
        start = torch.load(tmp_path / "two" / f"init_rank{r}.pt", weights_only=True)
        end = torch.load(tmp_path / "two" / f"final_rank{r}.pt", weights_only=True)
        assert start.keys() == init.keys() == end.keys()
        for k in init:
            assert torch.equal(start[k], init[k]), f"rank {r} starts from other weights: {k}"
            torch.testing.assert_close(end[k], ref[k], rtol=0, atol=0.01 * lr * ITERS,
                                       msg=f"rank {r}, 2 processes vs 1: {k}")
            moved = max(moved, float((ref[k] - init[k]).abs().max()))
    assert moved > 0.1 * lr  # it trained
    if case == "lora":
        assert any("lora_A" in k for k in init)
    m1, m2 = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["iteration"] for r in m2] == list(range(1, ITERS + 1))
    for a, b in zip(m1, m2):
        assert a["pairs_trained"] == b["pairs_trained"] and a["nfe_update"] == b["nfe_update"]
        for k in ("reward_mean", "diversity", "loss", "kl", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), k


# ---------------------------------------------------------------------------------------------------------------
# Layout independence of the pieces
# ---------------------------------------------------------------------------------------------------------------


def test_shard_rows_and_validation():
    shards = [Shard.create(4, 3, r, 2, False) for r in range(2)]
    assert [(s.start, s.stop) for s in shards] == [(0, 6), (6, 12)]
    with pytest.raises(ValueError, match="prompts_per_iter=3 groups cannot be shared evenly by 2 processes"):
        Shard.create(3, 2, 0, 2, False)
    split = [Shard.create(3, 2, r, 2, True) for r in range(2)]  # B = 6: group 1 spans both ranks
    assert [(s.start, s.stop) for s in split] == [(0, 3), (3, 6)]
    with pytest.raises(ValueError):
        Shard.create(3, 3, 0, 2, True)  # B = 9 is not a multiple of 2


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("groups, size, world", [(4, 2, 2), (4, 2, 4), (3, 2, 2)])
def test_layout_noise_does_not_depend_on_the_process_count(shared, groups, size, world):
    latent, T = (2, 3, 3), 4
    init1, step1 = layout_noise(7, 5, Shard(groups, size, 0, 1), latent, T, shared)
    assert init1.shape == (groups * size, *latent) and step1.shape == (groups * size, T, *latent)
    parts = [layout_noise(7, 5, Shard(groups, size, r, world), latent, T, shared) for r in range(world)]
    assert torch.equal(torch.cat([p[0] for p in parts]), init1)
    assert torch.equal(torch.cat([p[1] for p in parts]), step1)
    if shared:
        assert torch.equal(init1[0], init1[1]) and not torch.equal(init1[0], init1[size])
    # another iteration draws other noise
    assert not torch.equal(layout_noise(7, 6, Shard(groups, size, 0, 1), latent, T, shared)[1], step1)


@pytest.mark.parametrize("steps_per_sample, skip_zero, loss_mean", [(0, True, "planned"), (0, True, "nonzero"),
                                                                   (1, False, "planned")])
def test_update_plan_is_the_one_process_plan_cut_by_rows(steps_per_sample, skip_zero, loss_mean):
    B, T = 8, 3
    adv = torch.randn(B, T)
    adv[1] = 0.0
    mask = torch.tensor([True, True, False])
    kw = dict(seed=3, iteration=2, inner_epochs=2, updates_per_epoch=3, steps_per_sample=steps_per_sample,
              skip_zero_adv=skip_zero, loss_mean=loss_mean)
    n1, c1, plan1 = plan_update(adv, mask, Shard(4, 2, 0, 1), **kw)
    plans = [plan_update(adv, mask, Shard(4, 2, r, 2), **kw) for r in range(2)]
    assert all((n, c) == (n1, c1) for n, c, _ in plans)
    for e, epoch in enumerate(plan1):
        for c, (pairs, n_global, todo) in enumerate(epoch):
            assert todo == pairs  # one process: its pairs are every rank's, in the same order
            if not (skip_zero and loss_mean == "planned"):
                assert n_global == len(pairs)
            merged = []
            for r, (_, _, p) in enumerate(plans):
                mine, n_r, todo_r = p[e][c]
                assert n_r == n_global and todo_r == todo  # every rank: the global count and the global pairs
                merged += [(b + 4 * r, j) for b, j in mine]
            assert sorted(merged) == sorted(pairs)
    if skip_zero:
        assert all(b != 1 for epoch in plan1 for chunk in epoch for b, _ in chunk.mine)


# ---------------------------------------------------------------------------------------------------------------
# Memory switches
# ---------------------------------------------------------------------------------------------------------------


def _weights(tr):
    return {k: v.detach().clone() for k, v in tr.model.net.state_dict().items()}


def test_offload_optimizer_is_honoured_and_exact(tmp_path, model_path):
    plain = ds.make_trainer(model_path, tmp_path / "plain")
    plain.train()
    off = ds.make_trainer(model_path, tmp_path / "off", "optim.offload_optimizer=true")
    assert type(off.opt).__name__ == "OffloadedAdamW"
    assert all(m.device.type == "cpu" for m in off.opt.master)
    off.train()
    a, b = _weights(plain), _weights(off)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the optimizer state has the plain layout: a plain run resumes from an offloaded checkpoint
    st = checkpoint.load(tmp_path / "off" / "checkpoints" / "iter000002")
    plain.opt.load_state_dict(st["optimizer"])


def test_offload_reference_is_honoured(tmp_path, model_path):
    tr = ds.make_trainer(model_path, tmp_path / "ref", "optim.kl_beta=0.1", "optim.offload_reference=true", "optim.micro_batch=5")
    assert tr.ref_model is not None and tr.ref_offload.enabled
    moves = []
    orig_to = tr.ref_model.to

    def spy_to(*a, **k):
        moves.append(str(a[0]) if a else str(k))
        return orig_to(*a, **k)

    tr.ref_model.to = spy_to
    stats = tr.train_step().metrics()
    assert stats["kl"] >= 0 and stats["pairs_trained"] > 0
    assert moves == [str(tr.device), "cpu"]  # onto the device for the update, parked after it
    assert all(p.device.type == "cpu" for p in tr.ref_model.parameters())
    plain = ds.make_trainer(model_path, tmp_path / "ref_off", "optim.kl_beta=0.1", "optim.micro_batch=5")
    assert not plain.ref_offload.enabled
    pstats = plain.train_step().metrics()
    # the reference means computed up front (offloaded) give the same KL, loss, NFE and weights as per micro-batch
    assert stats["nfe_update"] == pstats["nfe_update"]
    for k in ("kl", "loss", "grad_norm"):
        assert stats[k] == pytest.approx(pstats[k], rel=1e-5, abs=1e-12), k
    a, b = _weights(tr), _weights(plain)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)


def test_gradient_checkpointing_switch_keeps_the_gradient(tmp_path, model_path):
    grads = {}
    for gc in ("false", "true"):
        tr = ds.make_trainer(model_path, tmp_path / f"gc{gc}", f"model.gradient_checkpointing={gc}", "optim.grad_clip=1e9")
        assert all(getattr(b, "_fc_checkpointed", False) == (gc == "true") for b in tr.model.net.blocks)
        tr.opt.step = lambda *a, **k: None
        tr.train_step().metrics()
        grads[gc] = {n: p.grad.clone() for n, p in tr.model.net.named_parameters() if p.grad is not None}
    assert grads["true"].keys() == grads["false"].keys() and grads["true"]
    for n, g in grads["false"].items():
        torch.testing.assert_close(grads["true"][n], g, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------------------------
# Which steps a sample trains (sampler.train_step_draw)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, k", [(9, 3), (9, 2), (10, 3), (5, 5), (4, 7), (7, 1)])
def test_systematic_steps_keep_the_inclusion_probability_and_spread(n, k):
    """Every index with probability exactly min(k, n)/n (the u that pick index j form an interval of length 1 of
    [0, n/k)); k distinct indices, consecutive ones ⌊n/k⌋ or ⌈n/k⌉ apart."""
    if k >= n:
        assert systematic_steps(n, k, 0.3) == list(range(n))
        return
    stride = n / k
    # exact: the chosen set is a step function of u; integrate it over a fine grid of u (midpoints)
    grid = 20000
    counts = torch.zeros(n)
    for m in range(grid):
        counts[systematic_steps(n, k, (m + 0.5) / grid)] += 1
    assert torch.allclose(counts / grid, torch.full((n,), k / n), atol=2e-4)
    for s in range(50):  # distinct, evenly spread
        picked = systematic_steps(n, k, float(torch.rand((), generator=torch.Generator().manual_seed(s))))
        assert len(set(picked)) == k and picked == sorted(picked)
        assert all(b - a in (math.floor(stride), math.ceil(stride)) for a, b in zip(picked, picked[1:]))


def test_update_plan_systematic_draw_spreads_each_samples_steps():
    B, T = 6, 10
    mask = torch.tensor([True] * 9 + [False])
    kw = dict(seed=1, iteration=3, inner_epochs=1, updates_per_epoch=1, steps_per_sample=3, skip_zero_adv=False)
    _, _, plan = plan_update(torch.ones(B, T), mask, Shard(B, 1, 0, 1), step_draw="systematic", **kw)
    pairs = plan[0][0][0]
    for b in range(B):
        steps = sorted(j for bb, j in pairs if bb == b)
        assert [j // 3 for j in steps] == [0, 1, 2]  # one step in each third of the 9 trainable steps
    # the same draw for the members of a group (crn) as with the random draw
    _, _, plan = plan_update(torch.ones(B, T), mask, Shard(3, 2, 0, 1), step_draw="systematic", step_groups=[0, 0, 1, 1, 2, 2], **kw)
    pairs = plan[0][0][0]
    assert sorted(j for b, j in pairs if b == 0) == sorted(j for b, j in pairs if b == 1)


def test_nft_step_draw_window_is_int_t_fraction_of_all_t_steps():
    from flowcredit.trainer.distributed import step_draw_window

    assert step_draw_window("nft", 10, 0.99, 0) == (1.0, 9)  # DiffusionNFT: num_train_timesteps = int(10·0.99)
    assert step_draw_window("nft", 10, 0.5, 0) == (1.0, 5)
    assert step_draw_window("random", 10, 0.99, 3) == (0.99, 3)  # the other draws: the sampler's settings
    assert step_draw_window("systematic", 10, 0.99, 0) == (0.99, 0)


def test_nft_step_draw_is_diffusionnfts_permutation_of_every_grid_time():
    """Hold-out against NVlabs/DiffusionNFT scripts/train_nft_sd3.py @ 24af555 (transcribed from that file): per
    sample `perms_time = torch.randperm(num_timesteps)` over all T = `sample.num_steps` grid times, and the loop
    `for j_idx in range(num_train_timesteps)` trains the first int(T·timestep_fraction) of the permuted times. With the
    plan's seeded generator of the row the plan trains exactly those steps."""
    from flowcredit.trainer.distributed import STREAM_STEP_SUBSET, derived_generator, step_draw_window

    B, T, seed, it = 6, 10, 3, 7
    fraction, k = step_draw_window("nft", T, 0.99, 0)
    mask = torch.arange(T) < int(T * fraction)  # the forward-process objectives' trained_steps at fraction 1
    assert bool(mask.all())
    kw = dict(seed=seed, iteration=it, inner_epochs=1, updates_per_epoch=1, steps_per_sample=k, skip_zero_adv=False)
    _, _, plan = plan_update(torch.ones(B, T), mask, Shard(B, 1, 0, 1), step_draw="nft", **kw)
    pairs = plan[0][0].pairs
    for b in range(B):
        num_timesteps, num_train_timesteps = T, int(T * 0.99)
        perms_time = torch.randperm(num_timesteps, generator=derived_generator(seed, STREAM_STEP_SUBSET, it, b))
        official = {int(perms_time[j_idx]) for j_idx in range(num_train_timesteps)}
        assert {j for bb, j in pairs if bb == b} == official and len(official) == 9


def test_nft_step_draw_inclusion_probabilities():
    """Every grid time, t_{T−1} included, is trained with probability int(T·f)/T = 0.9 (T = 10, f = 0.99), any two
    together with 9/10·8/9 = 0.8. Exact for the construction (the first k of a uniform permutation; enumerated over
    all 5! permutations at n = 5, k = 4: 4/5 and 3/5), and the plan's draws at T = 10 agree within 4.5 σ."""
    import itertools

    n, k = 5, 4
    perms = list(itertools.permutations(range(n)))
    single = [sum(j in p[:k] for p in perms) / len(perms) for j in range(n)]
    both = sum(0 in p[:k] and n - 1 in p[:k] for p in perms) / len(perms)
    assert single == [k / n] * n and both == pytest.approx(k * (k - 1) / (n * (n - 1)))  # 0.8 and 0.6
    B, T = 3000, 10
    kw = dict(seed=0, iteration=1, inner_epochs=1, updates_per_epoch=1, steps_per_sample=9, skip_zero_adv=False)
    _, _, plan = plan_update(torch.ones(B, T), torch.ones(T, dtype=torch.bool), Shard(B, 1, 0, 1), step_draw="nft",
                             **kw)
    steps = torch.zeros(B, T)
    for b, j in plan[0][0].pairs:
        steps[b, j] += 1
    assert bool((steps.sum(1) == 9).all()) and float(steps.max()) == 1.0  # 9 distinct times per sample
    sd = math.sqrt(0.9 * 0.1 / B)
    assert (steps.mean(0) - 0.9).abs().max() < 4.5 * sd, steps.mean(0)  # t_9 (j = 9) included: 0.9
    both = (steps[:, 0] * steps[:, T - 1]).mean()
    assert abs(float(both) - 0.8) < 4.5 * math.sqrt(0.8 * 0.2 / B)


def test_nft_step_draw_does_not_depend_on_the_process_layout():
    B, T = 8, 10
    adv = torch.randn(B, T, generator=torch.Generator().manual_seed(0))
    kw = dict(seed=5, iteration=2, inner_epochs=2, updates_per_epoch=2, steps_per_sample=9, skip_zero_adv=False,
              step_draw="nft")
    mask = torch.ones(T, dtype=torch.bool)
    for groups in (None, [b // 2 for b in range(B)]):  # with and without crn's per-group draw
        one = plan_update(adv, mask, Shard(B // 2, 2, 0, 1), step_groups=groups, **kw)
        ranks = [plan_update(adv, mask, Shard(B // 2, 2, r, 2), step_groups=groups, **kw) for r in (0, 1)]
        for e, chunks in enumerate(one[2]):
            for c, chunk in enumerate(chunks):
                assert all(rk[2][e][c].pairs == chunk.pairs for rk in ranks)  # every rank, the same global plan
                mine = [(b + r * B // 2, j) for r, rk in enumerate(ranks) for b, j in rk[2][e][c].mine]
                assert sorted(mine) == sorted(chunk.mine)


def test_update_plan_rejects_an_unknown_step_draw():
    kw = dict(seed=1, iteration=0, inner_epochs=1, updates_per_epoch=1, steps_per_sample=0, skip_zero_adv=False)
    with pytest.raises(ValueError, match="train_step_draw=.stratified.; use random, systematic, nft or awm"):
        plan_update(torch.ones(2, 4), torch.ones(4, dtype=torch.bool), Shard(2, 1, 0, 1), step_draw="stratified", **kw)


# ---------------------------------------------------------------------------------------------------------------
# sampler.train_step_draw=awm: AWM's `time_type = discrete_wo_init` (scxue/advantage_weighted_matching
# scripts/train_sd3_awm.py @ be51372), transcribed here from that file:
#   boundaries = torch.linspace(1, int(num_steps * timestep_fraction), steps=train_timesteps + 1)
#   lower_bounds = boundaries[:-1].long(); upper_bounds = boundaries[1:].long()
#   rand_u = torch.rand(train_timesteps)
#   t_indices = lower_bounds + (rand_u * (upper_bounds - lower_bounds)).long()
# ---------------------------------------------------------------------------------------------------------------


def _official_discrete_wo_init(num_steps, timestep_fraction, train_timesteps, rand_u):
    boundaries = torch.linspace(1, int(num_steps * timestep_fraction), steps=train_timesteps + 1)
    lower_bounds = boundaries[:-1].long()
    upper_bounds = boundaries[1:].long()
    return (lower_bounds + (rand_u * (upper_bounds - lower_bounds)).long()).tolist()


@pytest.mark.parametrize("T,frac,k", [(14, 0.9, 6), (10, 0.99, 3), (10, 0.99, 8), (20, 0.8, 5), (5, 1.0, 4)])
def test_awm_step_draw_is_the_awm_codes_draw(T, frac, k):
    from flowcredit.trainer.distributed import STREAM_STEP_SUBSET, derived_generator

    B, seed, it = 5, 2, 9
    n = int(T * frac)
    mask = torch.arange(T) < n  # the forward-process objectives' trained steps
    kw = dict(seed=seed, iteration=it, inner_epochs=1, updates_per_epoch=1, steps_per_sample=k, skip_zero_adv=False)
    _, _, plan = plan_update(torch.ones(B, T), mask, Shard(B, 1, 0, 1), step_draw="awm", **kw)
    for b in range(B):
        rand_u = torch.rand(k, generator=derived_generator(seed, STREAM_STEP_SUBSET, it, b))
        official = _official_discrete_wo_init(T, frac, k, rand_u)
        assert sorted(j for bb, j in plan[0][0].pairs if bb == b) == sorted(official)
        assert len(set(official)) == k and 0 not in official


def test_awm_step_draw_inclusion_probabilities_by_enumeration():
    """Exact: each stratum's uniform enumerated on the midpoints of L equal cells (L a multiple of every stratum's
    width, so ⌊u·w⌋ takes each value on exactly L/w cells). Released recipe (n = 12, k = 6): step 1 always, steps
    2..11 with probability 1/2, step 0 never."""
    from flowcredit.trainer.distributed import awm_steps, awm_strata

    def inclusion(n, k):
        widths = [hi - lo for lo, hi in awm_strata(n, k)]
        L = math.lcm(*widths)
        counts = [0] * n
        for m in range(L):  # the strata are independent: one u for all of them gives every marginal
            for j in awm_steps(n, k, torch.full((k,), (m + 0.5) / L)):
                counts[j] += 1
        return [c / L for c in counts]

    assert awm_strata(12, 6) == [(1, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]
    assert inclusion(12, 6) == [0.0, 1.0] + [0.5] * 10
    assert inclusion(10, 3) == [0.0] + [1 / 3] * 9  # strata [1,4), [4,7), [7,10)
    p = inclusion(9, 3)  # widths 2, 3, 3 (⌊1 + 8i/3⌋: 1, 3, 6, 9)
    assert p == [0.0, 0.5, 0.5] + [pytest.approx(1 / 3)] * 6 and sum(p) == pytest.approx(3)
    with pytest.raises(ValueError, match="1 ≤ train_steps_per_sample ≤ 11"):
        awm_strata(12, 12)


def test_awm_step_draw_does_not_depend_on_the_process_layout():
    B, T = 8, 14
    adv = torch.randn(B, T, generator=torch.Generator().manual_seed(0))
    kw = dict(seed=5, iteration=2, inner_epochs=2, updates_per_epoch=2, steps_per_sample=6, skip_zero_adv=False,
              step_draw="awm")
    mask = torch.arange(T) < 12
    for groups in (None, [b // 2 for b in range(B)]):  # per sample, and per group (crn)
        one = plan_update(adv, mask, Shard(B // 2, 2, 0, 1), step_groups=groups, **kw)
        ranks = [plan_update(adv, mask, Shard(B // 2, 2, r, 2), step_groups=groups, **kw) for r in (0, 1)]
        for e, chunks in enumerate(one[2]):
            for c, chunk in enumerate(chunks):
                assert all(rk[2][e][c].pairs == chunk.pairs for rk in ranks)
                mine = [(b + r * B // 2, j) for r, rk in enumerate(ranks) for b, j in rk[2][e][c].mine]
                assert sorted(mine) == sorted(chunk.mine)
        if groups is not None:  # the members of a group share their times
            steps = {b: sorted(j for bb, j in one[2][0][0].pairs + one[2][0][1].pairs if bb == b) for b in range(B)}
            assert all(steps[b] == steps[b + 1] for b in range(0, B, 2))
