"""Launch helper of the scale and fault tests: the tiny test run, in this process or in each of N processes.

    python tests/trainer/dist_script.py MODEL OUT_DIR [key=value ...]                       # 1 process
    (MODEL = a tiny model file, or ``default`` for the default job: tiny_nft on the shipped model, 4 iterations)
    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/trainer/dist_script.py MODEL OUT_DIR [key=value ...]                          # 2 processes (gloo)

The reward is ``image_mean_reward`` (deterministic, distinct per sample). Each rank writes
``OUT_DIR/init_rank{r}.pt`` with its model weights after setup and ``OUT_DIR/final_rank{r}.pt`` after training; with ``dist.fsdp=true`` these are the FULL weights
gathered from the shards before the process group closes, and ``OUT_DIR/shards_rank{r}.pt`` holds the number of
elements of each tensor this rank stored (its shard). ``FLOWCREDIT_FAULT_INJECT=phase:iteration`` kills
the process at that point (flowcredit/trainer/faults.py). Exit code: 0 done, 3 stopped by a fault.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT / "src") not in sys.path:
    sys.path.insert(0, str(_ROOT / "src"))

from flowcredit.cli.main import PRESET_DIR  # noqa: E402
from flowcredit.config import load_config  # noqa: E402
from flowcredit.config.schema import TrainConfig  # noqa: E402
from flowcredit.rewards.base import RewardOutput  # noqa: E402

P, G, T = 4, 2, 3  # global prompts per iteration, group size, rollout steps


def image_mean_reward(images, prompts, metadata, **kw):
    """Deterministic, distinct per sample, so group advantages are non-zero."""
    return RewardOutput(scores=images.float().mean(dim=(1, 2, 3)))


class ImageMeanReward:
    """``image_mean_reward`` as a reward class, for configs: ``reward.name=dist_script:ImageMeanReward``."""

    def __call__(self, images, prompts, metadata, **kw):
        return image_mean_reward(images, prompts, metadata)


class NaNReward(ImageMeanReward):
    """NaN from the second call on (a reward model gone bad after one good iteration)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, images, prompts, metadata, **kw):
        self.calls += 1
        out = super().__call__(images, prompts, metadata)
        if self.calls > 1:
            out.scores[0] = float("nan")
        return out


class NaNOnRank1Reward(ImageMeanReward):
    """NaN scores on rank 1 only (RANK from the launcher): every rank must still skip, and stop, together."""

    def __call__(self, images, prompts, metadata, **kw):
        out = super().__call__(images, prompts, metadata)
        if os.environ.get("RANK") == "1":
            out.scores[0] = float("nan")
        return out


class SigtermAtIteration2Reward(ImageMeanReward):
    """Sends SIGTERM to its own process during the second reward call (iteration 2 of a flow_grpo run)."""

    calls = 0

    def __call__(self, images, prompts, metadata, **kw):
        import signal

        type(self).calls += 1
        if type(self).calls == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().__call__(images, prompts, metadata)


def make_model(directory: Path) -> Path:
    """A random width-32 tiny model with perturbed zero-init layers (as in test_loop.py)."""
    from flowcredit.models.tiny import TinyDiTConfig, TinyFlowModel

    torch.manual_seed(0)
    model = TinyFlowModel(TinyDiTConfig(width=32, depth=1, heads=2))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.net.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.save(directory, name="m")


def overrides(model_path, out_dir, *extra: str) -> list[str]:
    return [
        f"model.path={model_path}", "model.precision=fp32", f"sampler.num_steps={T}", f"data.prompts_per_iter={P}",
        f"data.group_size={G}", "run.iterations=2", "run.threads=1", f"run.out_dir={out_dir}",
        "run.eval_prompts=shapes:test_unique", "run.eval_steps=2", "run.eval_subset=2", "run.eval_at_end=false",
        "run.grid_every=0", "optim.lr=1e-3", *extra,
    ]


def default_job_overrides(out_dir, *extra: str) -> list[str]:
    """The default job (tiny_nft on the shipped model, its batch, steps and reward) shortened to 4 iterations without
    evaluations, grids or time budget; fp32 so that 1 and N processes run the same kernels on every CPU kind."""
    return [
        "model.precision=fp32", "run.iterations=4", "run.threads=1", f"run.out_dir={out_dir}", "run.eval_at_end=false",
        "run.eval_baseline=false", "run.budget_minutes=0", "run.grid_every=0", *extra,
    ]


def make_trainer(model_path, out_dir, *extra: str, reward=image_mean_reward):
    """The trainer of the test run; ``model_path="default"`` is the default job (`default_job_overrides`, its own
    shapes reward), else the tiny test run on the model at `model_path`."""
    from flowcredit.trainer.loop import Trainer

    if str(model_path) == "default":
        cfg = load_config(TrainConfig, "tiny_nft", default_job_overrides(out_dir, *extra), preset_dirs=[PRESET_DIR])
        reward = None
    else:
        cfg = load_config(TrainConfig, "tiny_flow_grpo", overrides(model_path, out_dir, *extra),
                          preset_dirs=[PRESET_DIR])
    tr = Trainer(cfg, preset_name="test")
    tr.setup()
    if reward is not None:
        tr.reward_fn = reward
    return tr


def main(argv: list[str]) -> int:
    from flowcredit.trainer.faults import RunStopped

    model_path, out_dir, extra = argv[0], Path(argv[1]), argv[2:]
    own_reward = any(o.startswith("reward.name=") for o in extra)  # else the test reward image_mean_reward
    tr = make_trainer(model_path, out_dir, *extra, reward=None if own_reward else image_mean_reward)
    rank = tr.dist.rank
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in tr.model.net.state_dict().items()}, out_dir / f"init_rank{rank}.pt")
    gathered: dict[str, torch.Tensor] = {}
    if tr.dist.fsdp:  # train() closes the process group at its end: gather the full weights just before
        close = tr.dist.close

        def gather_then_close(barrier: bool = True) -> None:
            if barrier:
                gathered.update(full_weights(tr.model.net))
                torch.save({k: local_numel(v) for k, v in tr.model.net.state_dict().items()}, out_dir / f"shards_rank{rank}.pt")
            close(barrier)

        tr.dist.close = gather_then_close
    try:
        tr.train()
    except RunStopped as e:
        print(f"error: {e}", file=sys.stderr)
        tr.dist.close(barrier=False)
        return 3
    final = gathered or {k: v.detach().clone() for k, v in tr.model.net.state_dict().items()}
    torch.save(final, out_dir / f"final_rank{rank}.pt")
    return 0


def full_weights(net) -> dict[str, torch.Tensor]:
    """The full weights of a (possibly FSDP-sharded) network on this rank: DTensor shards are all-gathered."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in net.state_dict().items()}


def local_numel(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).numel()


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT / "src"), str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("FLOWCREDIT_FAULT_INJECT", None)
    return env


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
