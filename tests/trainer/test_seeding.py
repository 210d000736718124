"""run.seed makes a run reproducible: two runs of one command give identical metrics (timing aside) and weights,
whatever the process-global RNGs held before (the trainer seeds torch / numpy / random itself), for every
`model.trainable` mode of the tiny model and for LoRA on tiny SD3 and FLUX.1; one training iteration never draws
from the global RNGs (every draw of flowcredit's own comes from a generator derived from (seed, stream, ...))."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_script as ds  # noqa: E402

from flowcredit.trainer.distributed import seed_global_rngs  # noqa: E402

TIMING = ("seconds", "seconds_total")


def metrics(out: Path) -> list[dict]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        for k in TIMING:
            r.pop(k, None)
    return recs


def scramble_global_rngs(value: int) -> None:
    """Leave the global RNGs in an arbitrary state, as whatever ran before in the process would."""
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)
    torch.rand(value % 7 + 1)


def run_twice(make, tmp_path: Path):
    """Build and train the same run twice after different global-RNG histories: (initial, final weights, metrics)."""
    out = []
    for i, junk in enumerate((123, 98765)):
        scramble_global_rngs(junk)
        tr = make(tmp_path / f"run{i}")
        init = {k: v.detach().clone() for k, v in tr.model.net.state_dict().items()}
        tr.train()
        final = {k: v.detach().clone() for k, v in tr.model.net.state_dict().items()}
        out.append((init, final, metrics(tmp_path / f"run{i}")))
    return out


def assert_identical(a, b):
    (init_a, final_a, m_a), (init_b, final_b, m_b) = a, b
    assert init_a.keys() == init_b.keys()
    for k in init_a:
        assert torch.equal(init_a[k], init_b[k]), f"initial {k} differs"
        assert torch.equal(final_a[k], final_b[k]), f"final {k} differs"
    assert m_a == m_b


@pytest.mark.parametrize("trainable", ["all", "blocks", "modulation", "lora"])
def test_two_runs_of_one_command_are_identical_tiny(tmp_path, model_path, trainable):
    extra = [f"model.trainable={trainable}", "model.lora_rank=4", "model.lora_alpha=8", "run.seed=11",
             "run.checkpoint_every=0"]
    a, b = run_twice(lambda out: ds.make_trainer(model_path, out, *extra), tmp_path)
    assert_identical(a, b)
    init, final, m = a
    assert any(not torch.equal(init[k], final[k]) for k in init), "nothing trained"
    if trainable == "lora":  # peft initialises A from the global RNG: seeded, it is not the junk's draw
        assert any("lora_A" in k for k in init)
    assert [r["iteration"] for r in m] == [1, 2]


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_two_runs_of_one_command_are_identical_lora_diffusers(tmp_path, kind):
    from flowcredit.trainer.loop import Trainer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import tiny_diffusers as td

    def make(out):
        tr = Trainer(td.train_config(kind, "flow_grpo", out, "run.seed=5", "run.checkpoint_every=0"))
        tr.setup()
        return tr

    a, b = run_twice(make, tmp_path)
    assert_identical(a, b)
    assert sum("lora_A" in k for k in a[0]) > 0


def test_seed_global_rngs_per_rank_differs_and_base_is_the_seed():
    seed_global_rngs(7)
    base = (torch.rand(3), np.random.rand(), random.random())
    torch.manual_seed(7)
    assert torch.equal(base[0], torch.rand(3))  # rank=None: the seed itself, the same on every rank
    seed_global_rngs(7, 0)
    r0 = torch.rand(3)
    seed_global_rngs(7, 1)
    r1 = torch.rand(3)
    seed_global_rngs(7, 1)
    assert torch.equal(torch.rand(3), r1) and not torch.equal(r0, r1)


def test_one_iteration_never_draws_from_the_global_rngs(tmp_path, model_path):
    """What the run draws randomly comes from derived generators: the global states are the same after an
    iteration of each objective (so no rank offset, plugin or earlier code can change what the run computes)."""
    for preset in (["method=stepwise", "estimate.substeps=2"], ["objective.name=nft", "sampler.name=ode"]):
        tr = ds.make_trainer(model_path, tmp_path / preset[0].replace("=", "_"), *preset)
        before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
        tr.train_step().metrics()
        after = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
        assert torch.equal(before[0], after[0]), preset
        assert np.array_equal(before[1], after[1]) and before[2] == after[2], preset
        tr.close()
