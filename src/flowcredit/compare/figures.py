"""The Stepwise Fig. 1 analogue of a study report: intermediate rewards ρ_j of one prompt's samples."""

from __future__ import annotations

from pathlib import Path


def reward_trajectory_figure(run: Path, png: Path, prompt_index: int = 0, group: int = 2, seed: int = 0) -> None:
    """Draw ρ_j for `group` samples of one held-out prompt (shared x_T) and their x̂0 images (Fig. 1 analogue)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from ..config import load_config
    from ..config.schema import TrainConfig
    from ..models.loading import load_any_model
    from ..rewards.shapes import ShapesReward
    from ..samplers.estimates import trajectory_estimates
    from ..samplers.rollout import make_initial_noise, rollout
    from ..samplers.schedules import time_grid
    from ..shapes.prompts import load_prompts
    from ..types import to_uint8_hwc

    cfg = load_config(TrainConfig, str(run / "config.yaml"))
    model = load_any_model(str(run), "fp32")
    ps = load_prompts("shapes:test_unique")
    k = [i for i, m in enumerate(ps.metadata) if m["tag"] == "two_object"][prompt_index]
    prompts, meta = [ps.prompts[k]] * group, [ps.metadata[k]] * group
    gids = torch.zeros(group, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    own_grid = getattr(model, "time_grid", None)  # sampler.grid=model: the model's own scheduler sigmas
    grid = (own_grid(cfg.sampler.num_steps) if cfg.sampler.grid == "model" and callable(own_grid)
            else time_grid(cfg.sampler.num_steps, cfg.sampler.shift, cfg.sampler.grid))
    init = make_initial_noise(group, tuple(model.latent_shape), gids, True, gen)
    traj = rollout(
        model,
        prompts,
        meta,
        gids,
        timesteps=grid,
        sampler=cfg.sampler,
        guidance_scale=cfg.sampler.guidance_scale,
        generator=gen,
        init_noise=init,
        keep_velocities=True,
    )
    cond = model.encode_prompts(prompts)
    est = trajectory_estimates(model, traj, cond, None, 1.0, cfg.estimate.substeps, 64, True)
    T = traj.num_steps
    imgs = model.decode(est.x0_hat.reshape(group * (T + 1), *est.x0_hat.shape[2:]))
    rho = ShapesReward()(imgs, [prompts[0]] * len(imgs), [meta[0]] * len(imgs)).scores.view(group, T + 1)
    u8 = to_uint8_hwc(imgs).numpy().reshape(group, T + 1, *imgs.shape[2:], 3)
    fig = plt.figure(figsize=(1.1 * (T + 1), 2.5 + 1.1 * group))
    ax = fig.add_axes((0.1, 1 - 2.1 / (2.5 + 1.1 * group), 0.88, 1.6 / (2.5 + 1.1 * group)))
    for i in range(group):
        ax.plot(range(T + 1), rho[i].numpy(), marker="o", label=f"sample {i}")
    ax.set_xlabel("state j (t = 1 → 0)")
    ax.set_ylabel("ρ_j")
    ax.set_title(f"'{prompts[0]}'", fontsize=9)
    ax.legend(fontsize=7)
    for i in range(group):
        for j in range(T + 1):
            a = fig.add_axes(
                (
                    0.06 + 0.92 * j / (T + 1),
                    (group - 1 - i) * 1.1 / (2.5 + 1.1 * group) + 0.01,
                    0.9 / (T + 1),
                    1.0 / (2.5 + 1.1 * group),
                )
            )
            a.imshow(u8[i, j], interpolation="nearest")
            a.axis("off")
    fig.savefig(png, dpi=90)
    plt.close(fig)
