"""Time grids and the SD3 shift (ALGORITHMS.md §1.4)."""

import pytest
import torch

from flowcredit.samplers.schedules import shift_time, time_grid, unshift_time


@pytest.mark.parametrize("kind", ["uniform", "diffusers"])
@pytest.mark.parametrize("num_steps", [1, 3, 10, 40])
def test_grid_shape_ends_and_monotone(kind, num_steps):
    grid = time_grid(num_steps, shift=3.0, kind=kind)
    assert grid.shape == (num_steps + 1,) and grid.dtype == torch.float32
    assert grid[0].item() == 1.0 and grid[-1].item() == 0.0
    assert bool((grid[1:] < grid[:-1]).all())


def test_diffusers_grid_matches_algorithms_table():
    # ALGORITHMS.md §1.4, SD3.5-M: T=10, shift=3. The last non-zero value is version dependent (0.0089 or ~0.0030),
    # so it is checked loosely.
    expected = [1.0000, 0.9601, 0.9133, 0.8577, 0.7904, 0.7073, 0.6022, 0.4649, 0.2780]
    grid = time_grid(10, shift=3.0, kind="diffusers")
    assert torch.allclose(grid[:9], torch.tensor(expected), atol=1e-3)
    assert 0.002 < grid[9].item() < 0.01
    assert grid[10].item() == 0.0


def test_uniform_grid_without_shift_is_linspace():
    assert torch.allclose(time_grid(4, shift=1.0), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


def test_shift_round_trip_float64():
    s = torch.linspace(0, 1, 101, dtype=torch.float64)
    for shift in (0.5, 1.0, 3.0, 7.5):
        t = shift_time(s, shift)
        assert t.dtype == torch.float64
        assert torch.allclose(unshift_time(t, shift), s, atol=1e-14, rtol=0)
    # shift > 1 moves every interior point towards the noise end
    assert bool((shift_time(s[1:-1], 3.0) > s[1:-1]).all())


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="kind"):
        time_grid(10, kind="karras")
    with pytest.raises(ValueError, match="num_steps"):
        time_grid(0)
    with pytest.raises(ValueError, match="shift"):
        shift_time(torch.tensor(0.5), 0.0)
