"""Prompt sampling for RL: P distinct prompts per iteration, each repeated G times with integer group ids."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..shapes.prompts import PromptSet


class PromptSampler:
    """Draws prompt groups from a PromptSet, seeded and resumable (`state_dict` holds the generator state).

    With `balance_tags` and GenEval-schema metadata, the tag is drawn uniformly first and then a prompt of that tag,
    so a split dominated by one tag (shapes: 640 of 738 train prompts are color_attr) still trains every skill.
    """

    def __init__(
        self, prompts: PromptSet, seed: int, balance_tags: bool = True, tag_weights: dict[str, float] | None = None
    ):
        """`tag_weights` (with balance_tags): relative probability of each tag (missing tags: 1, 0: never drawn).

        Raises ValueError (one line) for a tag the prompts do not have or weights that leave nothing to draw.
        """
        self.prompts = prompts
        self.rng = np.random.default_rng(np.random.SeedSequence([int(seed), 1]))
        self.by_tag: dict[str, list[int]] = {}
        for i, m in enumerate(prompts.metadata):
            key = m.get("tag", "") if balance_tags else ""
            self.by_tag.setdefault(key, []).append(i)
        self.tags = sorted(self.by_tag)
        self.p = None  # None: uniform over tags (the draws of a run without tag_weights are unchanged)
        if tag_weights:
            unknown = sorted(set(tag_weights) - set(self.tags))
            if unknown:
                raise ValueError(
                    f"data.tag_weights: tag {unknown[0]!r} is not in {prompts.source}; its tags: "
                    f"{', '.join(self.tags)}"
                )
            w = np.array([float(tag_weights.get(t, 1.0)) for t in self.tags])
            if w.sum() <= 0:
                raise ValueError("data.tag_weights: every tag has weight 0; give at least one tag a positive weight")
            self.p = w / w.sum()

    def draw(self, num_prompts: int, group_size: int) -> tuple[list[str], list[dict[str, Any]], torch.Tensor]:
        """Returns B = num_prompts·group_size prompts, metadata and group ids (B,) int64 (group-major order)."""
        idx = []
        ks = (
            self.rng.integers(len(self.tags), size=num_prompts)
            if self.p is None
            else self.rng.choice(len(self.tags), size=num_prompts, p=self.p)
        )
        for k in ks:
            pool = self.by_tag[self.tags[k]]
            idx.append(pool[int(self.rng.integers(len(pool)))])
        prompts = [self.prompts.prompts[i] for i in idx for _ in range(group_size)]
        meta = [self.prompts.metadata[i] for i in idx for _ in range(group_size)]
        gids = torch.arange(num_prompts, dtype=torch.long).repeat_interleave(group_size)
        return prompts, meta, gids

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]


@dataclasses.dataclass
class RunInputs:
    """What a run reads before anything is built: the prompt splits, the prompt sampler, reward and objective."""

    train_prompts: PromptSet
    eval_prompts: PromptSet | None  # None without run.eval_at_end / run.eval_every
    prompt_sampler: PromptSampler
    reward_fn: Any
    objective: Any


def load_run_inputs(cfg) -> RunInputs:
    """Read and check a run's inputs (cfg: TrainConfig); bad input is one TrainingError line naming the key, raised
    before anything is written."""
    from ..objectives import build_objective
    from ..rewards.registry import reward_from_config
    from ..shapes.prompts import load_prompts
    from .faults import one_line

    with one_line("data.train_prompts: "):
        train = load_prompts(cfg.data.train_prompts)
    with one_line():
        d = cfg.data
        sampler = PromptSampler(train, cfg.run.seed, d.balance_tags, d.tag_weights)
        reward_fn = reward_from_config(cfg.reward)
        objective = build_objective(cfg.objective.name, cfg.objective.options, cfg)
    check = getattr(reward_fn, "check_prompts", None)  # a reward may require prompt metadata (shapes)
    if callable(check):
        with one_line("data.train_prompts: "):
            check(train.metadata, train.source)
    evals = None
    if cfg.run.eval_at_end or cfg.run.eval_every:
        with one_line("run.eval_prompts: "):
            evals = load_prompts(cfg.run.eval_prompts)
    return RunInputs(train, evals, sampler, reward_fn, objective)
