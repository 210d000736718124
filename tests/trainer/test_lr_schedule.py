"""optim.lr_schedule: the learning rate over the run's progress (iterations or the time budget, whichever is further)."""

import time

import pytest

from flowcredit.trainer.harness import LRSchedule, TimeBudget


def test_constant_cosine_linear_and_warmup():
    lr = 1e-4
    const = LRSchedule(lr, "constant", 0.1, 0, 100)
    assert all(const(i) == lr for i in (0, 50, 99))
    cos = LRSchedule(lr, "cosine", 0.1, 0, 100)
    assert cos(0) == pytest.approx(lr)
    assert cos(50) == pytest.approx(lr * (0.1 + 0.9 * 0.5))
    assert cos(100) == pytest.approx(0.1 * lr)
    assert cos(25) == pytest.approx(lr * 0.868198052)  # 0.1 + 0.9 · (1 + cos(π/4)) / 2, by hand
    lin = LRSchedule(lr, "linear", 0.0, 0, 100)
    assert lin(30) == pytest.approx(0.7 * lr)
    warm = LRSchedule(lr, "constant", 0.1, 4, 100)
    assert [warm(i) / lr for i in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_budget_progress_drives_the_schedule_when_it_is_further():
    cos = LRSchedule(1e-4, "cosine", 0.0, 0, 1000)
    # 10 of 1000 iterations, but 3/4 of the time budget used: the schedule follows the budget
    assert cos(10, budget_progress=0.75) == pytest.approx(1.46446609e-5)  # 1e-4 · (1 + cos(3π/4)) / 2
    assert cos(900, budget_progress=0.1) == pytest.approx(2.44717419e-6)  # iterations further: (1 + cos(0.9π)) / 2


def test_past_its_length_the_schedule_stays_at_the_final_rate():
    # optim.lr_decay_iterations = 40 in a longer run: the decay takes 40 iterations, then lr·lr_final for good
    cos = LRSchedule(1e-4, "cosine", 0.1, 0, 40)
    assert cos(20) == pytest.approx(1e-4 * (0.1 + 0.9 * 0.5))
    assert [cos(i) for i in (40, 41, 500, 5000)] == pytest.approx([1e-5] * 4)
    assert cos(500, budget_progress=0.2) == pytest.approx(1e-5)  # the budget cannot raise it again


def test_time_budget_progress():
    b = TimeBudget(0.0, time.time(), lambda: 1000)
    assert b.progress() == 0.0  # no budget
    b = TimeBudget(10.0, time.time() - 150.0, lambda: 1000)  # 600 s budget, 150 s used
    assert b.progress() == 0.0  # nothing measured yet
    b.record(1.0, nfe_rollout=100.0, rollout_seconds=1.0)  # 100 forward-images/s → eval predicted 1.1·10 + 10 = 21 s
    assert b.progress() == pytest.approx(150.0 / (600.0 - 21.0), abs=2e-3)
