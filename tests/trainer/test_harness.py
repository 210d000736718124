"""Harness objects without a model: DistPadding (FSDP micro-batch padding) and RunLoop (when the loop stops)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flowcredit.trainer.harness import DistPadding, RunLoop, TimeBudget


class FakeDist:
    """`Dist` as DistPadding and RunLoop see it: `micro_batches` is the max over ranks under FSDP, `any` the OR."""

    def __init__(self, busiest_rank_pairs: int = 0, fsdp: bool = True):
        self.busiest, self.fsdp, self.is_main = busiest_rank_pairs, fsdp, True

    def micro_batches(self, n_pairs: int, micro_batch: int) -> int:
        mine = -(-n_pairs // micro_batch)
        return max(mine, -(-self.busiest // micro_batch)) if self.fsdp else mine

    def any(self, flag: bool) -> bool:
        return bool(flag)


MASK = torch.tensor([False, True, True, False])  # first trained step: 1


def test_padding_runs_as_many_passes_as_the_busiest_rank():
    pairs = [(0, 1), (0, 2), (1, 1)]
    chunks = list(DistPadding(FakeDist(busiest_rank_pairs=7), micro_batch=2).chunks(pairs, MASK))
    assert chunks == [([(0, 1), (0, 2)], False), ([(1, 1)], False), ([(0, 1)], True), ([(0, 1)], True)]


def test_no_padding_without_fsdp_or_when_this_rank_is_the_busiest():
    pairs = [(0, 1), (0, 2), (1, 1)]
    plain = list(DistPadding(FakeDist(busiest_rank_pairs=7, fsdp=False), 2).chunks(pairs, MASK))
    assert plain == [([(0, 1), (0, 2)], False), ([(1, 1)], False)]
    assert all(not pad for _, pad in DistPadding(FakeDist(busiest_rank_pairs=3), 2).chunks(pairs, MASK))
    assert list(DistPadding(FakeDist(fsdp=False), 2).chunks([], MASK)) == []


def test_padding_backward_adds_exactly_zero():
    w = torch.ones(3, requires_grad=True)
    DistPadding.backward_padding((w * 5.0).sum())
    assert torch.equal(w.grad, torch.zeros(3))


def _cfg(iterations=3, max_minutes=0.0):
    return SimpleNamespace(run=SimpleNamespace(iterations=iterations, max_minutes=max_minutes),
                           faults=SimpleNamespace(handle_signals=False), credit=SimpleNamespace(name="flow_grpo"),
                           objective=SimpleNamespace(name="grpo"))


def test_run_loop_stops_at_the_iteration_count_and_on_a_signal():
    budget = TimeBudget(0.0, 0.0, lambda: 0)
    stats = {"reward_mean": 0.5, "nfe_rollout": 10, "seconds": {"rollout": 1.0}}
    with RunLoop(_cfg(iterations=3), FakeDist(), budget, iteration=1) as loop:
        assert loop.running(1) and loop.running(2) and not loop.running(3)
        assert loop.end_iteration(stats, 2.0) and budget.iter_seconds == [2.0] and budget.fwd_rates == [10.0]
        loop.signals.requested = "SIGTERM"
        assert not loop.end_iteration(stats, 2.0)
        loop.close_bar()
    assert loop.result(2)["stopped"] == "SIGTERM" and loop.result(2)["iterations"] == 2


def test_run_loop_stops_before_an_iteration_the_budget_cannot_fit():
    budget = TimeBudget(1.0, 0.0, lambda: 10**9)  # 1 minute, created at the epoch: long over
    budget.record(1.0, 10, 1.0)
    loop = RunLoop(_cfg(iterations=100), FakeDist(), budget, iteration=0)
    assert not loop.running(5) and loop.result(5)["stopped_by_budget"] is True
    loop.close_bar()


def test_budget_counts_the_iterations_that_still_fit():
    budget = TimeBudget(10.0, 0.0, lambda: 900)  # 600 s; evaluation 1.1·900/10 + 10 = 109 s
    assert budget.iterations_left(100.0) is None  # nothing measured yet
    for sec in (2.0, 4.0, 3.0):
        budget.record(sec, 10, 1.0)  # 10 forward-images/s
    assert budget.iterations_left(100.0) == 130  # ⌊(600 − 109 − 100) / 3⌋
    assert budget.iterations_left(590.0) == 0
    assert TimeBudget(0.0, 0.0, lambda: 0).iterations_left(1.0) is None  # no budget


def test_progress_bar_total_follows_the_limit_that_ends_the_run_first():
    budget = TimeBudget(10.0, 0.0, lambda: 900)
    loop = RunLoop(_cfg(iterations=400), FakeDist(), budget, iteration=0)
    assert loop.bar.total == 400  # before any measurement: run.iterations
    loop.t_start = 0.0
    stats = {"reward_mean": 0.5, "nfe_rollout": 30, "seconds": {"rollout": 3.0}}  # 10 forward-images/s
    for _ in range(3):
        loop.end_iteration(stats, 3.0)
    left = budget.iterations_left()
    assert loop.bar.n == 3 and loop.bar.total == 3 + left < 400  # the budget ends it: ETA of ≈ 3 + left iterations
    assert loop.expected_total(20, now=100.0) == (20 + 130, "budget")  # ⌊(600 − 109 − 100) / 3⌋ = 130 more
    assert RunLoop(_cfg(iterations=100), FakeDist(), budget, 0).expected_total(20, now=100.0) == (100, "iterations")
    timed = RunLoop(_cfg(iterations=400, max_minutes=1.0), FakeDist(), TimeBudget(0.0, 0.0, lambda: 0), 0)
    timed.budget.record(2.0, 10, 1.0)
    timed.t_start = 0.0
    assert timed.expected_total(5, now=30.0) == (5 + 15, "max_minutes")  # 30 s left at 2 s an iteration
    for lp in (loop, timed):
        lp.close_bar()


def test_moving_reference_is_an_ema_of_the_policy_and_loads_back():
    from flowcredit.trainer.harness import MovingReference

    torch.manual_seed(0)
    policy, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref.load_state_dict(policy.state_dict())
    policy.bias.requires_grad_(False)  # a frozen weight: not tracked, stays the initial one
    moving = MovingReference(ref, ["weight"], decay=0.75)
    w0, b0 = ref.weight.detach().clone(), ref.bias.detach().clone()
    with torch.no_grad():
        policy.weight.add_(1.0)
        policy.bias.add_(5.0)
    moving.update([policy.weight])
    assert torch.equal(ref.weight, w0.lerp(policy.weight.detach(), 0.25))  # 0.75·ref + 0.25·θ
    torch.testing.assert_close(ref.weight, w0 + 0.25, rtol=0, atol=1e-6)
    assert torch.equal(ref.bias, b0)
    assert moving.tensors()[0] is ref.weight  # the live parameter: updates and loads act on the reference itself
    moving.load([torch.zeros(2, 3)])
    assert torch.equal(ref.weight, torch.zeros(2, 3))


def test_moving_reference_rejects_a_copy_without_the_trainable_names():
    import pytest

    from flowcredit.trainer.harness import MovingReference

    with pytest.raises(RuntimeError, match="lacks trainable parameters"):
        MovingReference(torch.nn.Linear(3, 2), ["net.blocks.0.weight"], decay=0.9)


def _official_return_decay(step, decay_type):
    """NVlabs/DiffusionNFT scripts/train_nft_sd3.py @ 24af555, `return_decay`, transcribed from that file."""
    if decay_type == 0:
        flat, uprate, uphold = 0, 0.0, 0.0
    elif decay_type == 1:
        flat, uprate, uphold = 0, 0.001, 0.5
    elif decay_type == 2:
        flat, uprate, uphold = 75, 0.0075, 0.999
    if step < flat:
        return 0.0
    decay = (step - flat) * uprate
    return min(decay, uphold)


def test_soft_update_decay_is_diffusionnfts_return_decay():
    import pytest

    from flowcredit.trainer.harness import soft_update_decay

    types = {0: (0.0, 0.0, 0), 1: (0.001, 0.5, 0), 2: (0.0075, 0.999, 75)}  # (rate, cap, flat) of decay_type
    for decay_type, (rate, cap, flat) in types.items():
        for step in (0, 1, 2, 74, 75, 76, 100, 209, 500, 1000, 5000):
            assert soft_update_decay(step, rate, cap, flat) == _official_return_decay(step, decay_type)
    # by hand: GenEval (type 1) 0.001 after one step, capped at 0.5 from step 500; OCR (type 2) 0 until step 75
    assert soft_update_decay(1, 0.001, 0.5) == pytest.approx(0.001)
    assert soft_update_decay(500, 0.001, 0.5) == 0.5 and soft_update_decay(501, 0.001, 0.5) == 0.5
    assert soft_update_decay(75, 0.0075, 0.999, 75) == 0.0
    assert soft_update_decay(100, 0.0075, 0.999, 75) == pytest.approx(0.1875)
    assert soft_update_decay(300, 0.0075, 0.999, 75) == 0.999


def test_soft_old_policy_updates_as_diffusionnft_and_swaps_in():
    from flowcredit.trainer.harness import SoftOldPolicy

    w = torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    old = SoftOldPolicy([w], rate=0.25, cap=0.5)
    assert torch.equal(old.shadow[0], w.detach()) and old.shadow[0] is not w  # starts at θ, a copy
    with torch.no_grad():
        w.add_(4.0)  # θ_1 = θ_0 + 4
    old.steps = 1
    assert old.update([w]) == 0.25
    # official: tgt.copy_(tgt·decay + src·(1 − decay)) = 0.25·θ_0 + 0.75·θ_1 = θ_0 + 3
    assert torch.equal(old.shadow[0], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    with old.swapped_in([w]):
        assert torch.equal(w.detach(), torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    assert torch.equal(w.detach(), torch.tensor([[5.0, 6.0], [7.0, 8.0]]))  # θ restored
    old.steps = 3  # d = min(0.75, 0.5) = 0.5
    assert old.update([w]) == 0.5 and torch.equal(old.shadow[0], torch.tensor([[4.5, 5.5], [6.5, 7.5]]))
    st = old.state_dict()
    fresh = SoftOldPolicy([w], 0.25, 0.5)
    fresh.load_state_dict(st)
    assert fresh.steps == 3


def test_moving_reference_decay_ramp_is_awms_linear_kl_ema_decay():
    # scxue/advantage_weighted_matching train_sd3_awm.py @ be51372: decay = min(kl_ema_decay, 0.001·global_step),
    # tgt ← tgt·decay + src·(1 − decay); here at the k-th optimizer step
    from flowcredit.trainer.harness import MovingReference

    policy, ref = torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(2, 1, bias=False)
    ref.load_state_dict(policy.state_dict())
    moving = MovingReference(ref, ["weight"], decay=0.3, rate=0.1)
    expect = ref.weight.detach().clone()
    for k in range(1, 6):
        with torch.no_grad():
            policy.weight.add_(1.0)
        moving.update([policy.weight])
        decay = min(0.3, 0.1 * k)  # 0.1, 0.2, 0.3, 0.3, 0.3
        expect = expect * decay + policy.weight.detach() * (1 - decay)
        torch.testing.assert_close(ref.weight.detach(), expect, rtol=0, atol=1e-6)
    assert moving.state_dict() == {"steps": 5}
