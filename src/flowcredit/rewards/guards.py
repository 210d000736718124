"""Reward-hacking guards the trainer can call (shared/docs/LANDSCAPE.md §3, item 3: users ask for held-out "gold"
metrics, diversity monitors and early stopping).

- `GoldMonitor`: a held-out "gold" reward (one the policy is not trained on, e.g. the shapes verifier while training on
  a CLIP score, or ImageReward while training on OCR) evaluated on fixed prompts every `every` iterations, with a
  history (`records`) that survives checkpoints (`state_dict` / `load_state_dict`).
- `pairwise_distance` / `group_diversity`: mean pairwise L2 distance of the samples of each prompt group, on pixels
  (RMS per element, so resolution-free) or on features you pass (e.g. CLIP embeddings). Collapsing diversity is the
  usual sign of mode collapse ("identical faces", flow_grpo#233 grid artifacts).
- `trend`: least-squares slope; `trend_se`: its standard error for independent points of known standard errors;
  `HackingAlarm`: fires when, over the last `window` gold evaluations, the fitted training reward rose by more than
  `train_rise` while the fitted gold reward fell by more than max(`gold_drop`, z standard errors of that fitted
  fall) (and, if diversity is fed, optionally when diversity fell by more than `diversity_drop`). z is either fixed
  (`noise_z`, a per-look test) or, with `alpha`, the k-th look's `spending_z(k, alpha)`, which bounds the chance that
  a run whose gold does not fall ever fires by `alpha`, however long the run (`spending_z`).

All are plain Python / torch, no trainer dependency. Typical use:

    gold = GoldMonitor.from_prompts(build_reward("shapes"), "shapes:test_unique", every=10, limit=32)
    alarm = HackingAlarm(window=5, noise_z=2.0)
    ...
    alarm.update_train(it, stats["reward_mean"])
    alarm.update_diversity(it, float(group_diversity(images, group_ids).mean()))
    if gold.due(it):
        rec = gold.run(it, lambda prompts, meta: sample(model, prompts))   # images (N, 3, H, W) in [0, 1]
        alarm.update_gold(it, rec.mean, se=rec.se)                          # se = std / sqrt(prompts)
        state = alarm.check()
        if state.fired: log(state.message)                                  # or stop / roll back
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Any

import torch
from torch import Tensor

from .base import check_output


# ------------------------------------------------------------------------------------------------ gold reward
@dataclass
class GoldRecord:
    """One gold evaluation: mean and (population) std of the scores over the images, the per-image scores, the mean
    of each component and `prompts`, the number of fixed prompts scored (0 in records saved before it was kept)."""

    iteration: int
    mean: float
    std: float
    scores: list[float]
    components: dict[str, float] = field(default_factory=dict)
    prompts: int = 0

    @property
    def se(self) -> float | None:
        """Standard error of `mean`: std / sqrt(number of prompts) (several samples of one prompt are not counted as
        independent, so with k > 1 samples per prompt it errs large); falls back to the number of scores for old
        records, None when there is nothing to count."""
        n = self.prompts or len(self.scores)
        return self.std / math.sqrt(n) if n > 0 else None


class GoldMonitor:
    """A held-out reward on fixed prompts, evaluated every `every` iterations.

    Args:
        reward: the gold reward (any reward callable).
        prompts, metadata: the fixed prompts (and their metadata; default {}).
        every: evaluate when iteration % every == 0 (0 = never due; `run`/`evaluate` still work).
        name: label for logs (`<name>/mean`).
    """

    def __init__(self, reward: Any, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None,
                 every: int = 10, name: str = "gold"):
        if not prompts:
            raise ValueError("GoldMonitor needs at least one prompt")
        self.reward, self.prompts = reward, list(prompts)
        self.metadata = [dict(m) for m in metadata] if metadata is not None else [{} for _ in self.prompts]
        if len(self.metadata) != len(self.prompts):
            raise ValueError(f"GoldMonitor: {len(self.prompts)} prompts but {len(self.metadata)} metadata")
        self.every, self.name = int(every), name
        self.records: list[GoldRecord] = []

    @classmethod
    def from_prompts(
        cls, reward: Any, spec: str, every: int = 10, limit: int | None = None, name: str = "gold"
    ) -> GoldMonitor:
        """Fixed prompts from a prompt spec (`shapes:test_unique`, a .txt or .jsonl file), first `limit` of them."""
        from ..shapes.prompts import load_prompts

        ps = load_prompts(spec)
        n = len(ps.prompts) if limit is None else min(limit, len(ps.prompts))
        return cls(reward, ps.prompts[:n], ps.metadata[:n], every=every, name=name)

    def due(self, iteration: int) -> bool:
        return self.every > 0 and iteration % self.every == 0

    def evaluate(self, iteration: int, images: Tensor) -> GoldRecord:
        """Score `images` generated for `self.prompts` (k samples per prompt: N = k·P, prompt-major or repeated in
        order, i.e. image i belongs to prompt i % P) and append a record."""
        n, p = images.shape[0], len(self.prompts)
        if n % p:
            raise ValueError(f"GoldMonitor: {n} images for {p} prompts (need a multiple)")
        k = n // p
        prompts, meta = self.prompts * k, self.metadata * k
        out = check_output(self.name, self.reward(images, prompts, meta), n)
        s = out.scores
        rec = GoldRecord(
            int(iteration),
            float(s.mean()),
            float(s.std(unbiased=False)),
            s.tolist(),
            {c: float(v.mean()) for c, v in out.components.items()},
            prompts=p,
        )
        self.records.append(rec)
        return rec

    def run(self, iteration: int, sample_fn: Callable[[list[str], list[dict[str, Any]]], Tensor]) -> GoldRecord:
        """Generate with `sample_fn(prompts, metadata) -> images (N, 3, H, W)` (fixed seed recommended), evaluate."""
        return self.evaluate(iteration, sample_fn(list(self.prompts), [dict(m) for m in self.metadata]))

    def series(self) -> tuple[list[int], list[float]]:
        return [r.iteration for r in self.records], [r.mean for r in self.records]

    def stats(self) -> dict[str, float]:
        """The latest record as flat log entries (`gold/mean`, `gold/std`, `gold/se`, `gold/<component>`)."""
        if not self.records:
            return {}
        r = self.records[-1]
        return {
            f"{self.name}/mean": r.mean,
            f"{self.name}/std": r.std,
            **({f"{self.name}/se": r.se} if r.se is not None else {}),
            **{f"{self.name}/{k}": v for k, v in r.components.items()},
        }

    def state_dict(self) -> dict[str, Any]:
        return {"records": [asdict(r) for r in self.records]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = [GoldRecord(**r) for r in state.get("records", [])]


# ------------------------------------------------------------------------------------------------ diversity
def pairwise_distance(x: Tensor, normalize: bool = True) -> Tensor:
    """Mean L2 distance over all pairs i < j of the rows of x (N, ...) → scalar (0 for N < 2).

    normalize=True divides by sqrt(D) (the RMS difference per element), so pixel distances do not grow with the
    resolution; for images in [0, 1] it lies in [0, 1].
    """
    n = x.shape[0]
    if n < 2:
        return torch.zeros((), dtype=torch.float32)
    f = x.detach().reshape(n, -1).double()
    d = torch.cdist(f[None], f[None])[0]
    iu = torch.triu_indices(n, n, offset=1)
    m = d[iu[0], iu[1]].mean()
    if normalize:
        m = m / (f.shape[1] ** 0.5)
    return m.float()


def group_diversity(
    samples: Tensor,
    group_ids: Sequence[int] | Tensor,
    features: Callable[[Tensor], Tensor] | None = None,
    normalize: bool | None = None,
) -> Tensor:
    """Within-group diversity: mean pairwise distance of the samples of each group → (G,), groups in sorted id order.

    Args:
        samples: (B, ...) images (or latents, or features).
        group_ids: (B,) prompt-group id of each sample.
        features: optional map samples → (B, D) features (e.g. `clip.image_embeds`) applied first.
        normalize: divide by sqrt(D) (default: True on raw samples, False on features).
    """
    g = torch.as_tensor(group_ids).reshape(-1)
    if g.numel() != samples.shape[0]:
        raise ValueError(f"group_diversity: {samples.shape[0]} samples but {g.numel()} group ids")
    x = features(samples) if features is not None else samples
    norm = (features is None) if normalize is None else normalize
    return torch.stack([pairwise_distance(x[g == gid], norm) for gid in torch.unique(g)])


# ------------------------------------------------------------------------------------------------ alarm
def _centred_x(n: int, xs: Sequence[float] | None) -> tuple[Tensor, float]:
    """(xc, Σ xc²): the positions xs (default 0, 1, …, n − 1) minus their mean, float64."""
    x = torch.as_tensor(list(xs), dtype=torch.float64) if xs is not None else torch.arange(n, dtype=torch.float64)
    xc = x - x.mean()
    return xc, float((xc * xc).sum())


def trend(values: Sequence[float], xs: Sequence[float] | None = None) -> float:
    """Least-squares slope of values against xs (default 0, 1, ...); 0 for fewer than 2 points."""
    y = torch.as_tensor(list(values), dtype=torch.float64)
    if y.numel() < 2:
        return 0.0
    xc, den = _centred_x(y.numel(), xs)
    return float((xc * (y - y.mean())).sum() / den) if den > 0 else 0.0


def trend_se(ses: Sequence[float | None], xs: Sequence[float] | None = None) -> float:
    """Standard error of `trend`'s least-squares slope when the points are independent with standard errors `ses`
    (None = 0): the slope is Σ w_i y_i with w_i = xc_i / Σ xc², xc = x − mean x, so its SE is
    sqrt(Σ xc_i² s_i²) / Σ xc². 0 for fewer than 2 points."""
    s = torch.as_tensor([0.0 if v is None else float(v) for v in ses], dtype=torch.float64)
    if s.numel() < 2:
        return 0.0
    xc, den = _centred_x(s.numel(), xs)
    return float((xc * xc * s * s).sum().sqrt() / den) if den > 0 else 0.0


def paired_change_se(scores: Sequence[Sequence[float] | None], xs: Sequence[float]) -> float | None:
    """Standard error of the fitted change (slope × span) of a mean over the SAME images at every point: each image's
    own least-squares change c_i across the points, SE = std(c_i) / sqrt(n) (n images). The gold prompts and their
    noise are fixed, so consecutive gold means share most of their images' scores; this paired SE counts only what
    changes, where the independent one (`trend_se`) counts each point's whole spread. None unless every point has
    scores of one length n ≥ 2 (then use `trend_se`)."""
    rows = [list(s) for s in scores if s is not None]
    if len(rows) < 2 or len(rows) != len(scores):
        return None
    n = len(rows[0])
    if n < 2 or any(len(r) != n for r in rows):
        return None
    y = torch.as_tensor(rows, dtype=torch.float64)  # (points, n)
    xc, den = _centred_x(len(rows), xs)
    if den <= 0:
        return None
    change = (xc[:, None] * (y - y.mean(0))).sum(0) / den * float(max(xs) - min(xs))  # (n,) per-image change
    return float(change.std(unbiased=True) / math.sqrt(n))


def spending_z(look: int, alpha: float) -> float:
    """One-sided z threshold of the `look`-th test (1, 2, …) of a run whose false-alarm budget `alpha` is spent as
    alpha / (k (k + 1)) at look k: z_k = Φ⁻¹(1 − alpha / (k (k + 1))).

    Σ_k alpha / (k (k + 1)) = alpha (it telescopes), so by the union bound the probability that ANY look of a run
    fires when gold does not fall is at most alpha, whatever the correlation between the looks (overlapping windows
    share most of their points) and however many looks the run makes. A fixed z per look instead fires at a rate of
    about Φ(−z) per look, so a long enough run is sure to fire once. The price is a threshold that rises slowly:
    with alpha = 0.05, z = 1.96, 2.39, 2.64 at looks 1–3, 3.32 at look 10, 3.67 at look 20 (a 4-hour run at the
    default cadence has ≈ 40 looks: 4.01).
    """
    if look < 1:
        raise ValueError(f"spending_z: looks count from 1, got {look}")
    if not 0 < alpha < 1:
        raise ValueError(f"spending_z: alpha must be in (0, 1), got {alpha}")
    return NormalDist().inv_cdf(1.0 - alpha / (look * (look + 1)))


@dataclass
class AlarmState:
    fired: bool
    train_change: float
    gold_change: float
    diversity_change: float | None
    reasons: list[str]
    message: str
    gold_se: float = 0.0  # standard error of gold_change (points without a standard error count as exact)
    gold_threshold: float = 0.0  # gold_change had to be below −gold_threshold = −max(gold_drop, z · gold_se)
    z: float = 0.0  # the z of this look: noise_z, or spending_z(look, alpha) with alpha
    look: int = 0  # 1 for the first check with min_points gold points, then one more per gold point (0 = waiting)
    warning: bool = False  # gold fell by more than max(gold_drop, noise_z · gold_se) while training rose (per look)


class HackingAlarm:
    """Fires when the training reward trends up while the gold reward trends down (over the last `window` gold points).

    Changes are fitted slopes × the window's iteration span, i.e. how much the linear fit rose or fell across the
    window. The alarm fires when train_change > train_rise and gold_change < −max(gold_drop, z · gold_se), where
    gold_se is the standard error of gold_change: `paired_change_se` when every point of the window came with its
    per-image scores, else `trend_se` × span from the standard errors passed to `update_gold` (a gold mean over 32
    prompts moves by ≈ 0.03 when one image flips, so at a plateau a fitted fall below a zero threshold is a coin
    flip); with `diversity_drop` set and diversity fed, also when diversity_change <
    −diversity_drop while train_change > train_rise.

    z: with `alpha` None it is `noise_z` at every look, a per-look test: each look of a healthy run fires with
    probability ≈ Φ(−noise_z) (2.3% at 2), and a 60-minute run at the default cadence makes about 10 looks. With
    `alpha` the k-th look uses `spending_z(k, alpha)`, and a healthy run fires at all with probability ≤ alpha. The
    k-th look is the check made when gold point min_points + k − 1 has arrived (derived from the gold history, so a
    resumed run counts on); several `check` calls at one gold point are one look. Beside the alarm, `warning` reports
    the per-look test at `noise_z` (with `alpha` None it fires with the alarm): a slow, steady fall crosses it looks
    before it crosses the rising z_k, so a warning without an alarm is worth a look at the gold curve.

    Args:
        window: gold points per check (>= 2); min_points: points needed before it can fire.
        train_rise, gold_drop, diversity_drop: thresholds (in reward / distance units).
        noise_z: how many standard errors of its fitted change gold must fall by, at every look, when `alpha` is None
            (0 = any fall below −gold_drop fires, the behaviour before the noise test; so does a window whose points
            have no standard error).
        alpha: the run's false-alarm budget for `gold_down` (0 < alpha < 1), spent over the looks (`spending_z`);
            None = the fixed `noise_z`.
    """

    def __init__(
        self,
        window: int = 5,
        min_points: int = 3,
        train_rise: float = 0.0,
        gold_drop: float = 0.0,
        diversity_drop: float | None = None,
        noise_z: float = 2.0,
        alpha: float | None = None,
    ):
        if window < 2 or min_points < 2:
            raise ValueError("HackingAlarm: window and min_points must be >= 2")
        if not noise_z >= 0:
            raise ValueError(f"HackingAlarm: noise_z must be >= 0, got {noise_z}")
        if alpha is not None and not 0 < alpha < 1:
            raise ValueError(f"HackingAlarm: alpha must be in (0, 1) or None, got {alpha}")
        self.alpha = None if alpha is None else float(alpha)
        self.window, self.min_points = int(window), int(min_points)
        self.train_rise, self.gold_drop, self.diversity_drop = float(train_rise), float(gold_drop), diversity_drop
        self.noise_z = float(noise_z)
        self.train: list[tuple[int, float]] = []
        self.gold: list[tuple[int, float]] = []
        self.gold_se: list[float | None] = []  # standard error of each gold point, aligned with self.gold
        self.gold_scores: list[list[float] | None] = []  # per-image scores of the last `window` gold points
        self.diversity: list[tuple[int, float]] = []

    def update_train(self, iteration: int, value: float) -> None:
        self.train.append((int(iteration), float(value)))

    def update_gold(
        self, iteration: int, value: float, se: float | None = None, scores: Sequence[float] | None = None
    ) -> None:
        """A gold point, its standard error (e.g. `GoldRecord.se` = std / sqrt(prompts); None = unknown, counted
        as 0) and optionally its per-image scores (`GoldRecord.scores`: the same fixed prompts and noise in the same
        order at every point). With scores at every point of a window the change's standard error is the paired one
        (`paired_change_se`), which cancels what the points share; only the last `window` score lists are kept."""
        self.gold.append((int(iteration), float(value)))
        self.gold_se.append(None if se is None else float(se))
        self.gold_scores.append(None if scores is None else [float(x) for x in scores])
        keep = len(self.gold) - self.window
        for i in range(max(0, keep)):
            self.gold_scores[i] = None

    def update_diversity(self, iteration: int, value: float) -> None:
        self.diversity.append((int(iteration), float(value)))

    @staticmethod
    def _change(points: list[tuple[int, float]], lo: int, hi: int) -> tuple[float, int]:
        pts = [(i, v) for i, v in points if lo <= i <= hi]
        if len(pts) < 2:
            return 0.0, len(pts)
        xs, ys = zip(*pts)
        return trend(ys, xs) * (hi - lo), len(pts)

    def check(self) -> AlarmState:
        gold = self.gold[-self.window :]
        if len(gold) < self.min_points:
            return AlarmState(
                False,
                0.0,
                0.0,
                None,
                [],
                f"waiting for {self.min_points} gold points ({len(gold)} so far)",
                gold_threshold=self.gold_drop,
            )
        look = len(self.gold) - self.min_points + 1
        z = self.noise_z if self.alpha is None else spending_z(look, self.alpha)
        lo, hi = gold[0][0], gold[-1][0]
        g, _ = self._change(gold, lo, hi)
        xs = [i for i, _ in gold]
        paired = paired_change_se(self.gold_scores[-len(gold) :], xs)
        g_se = paired if paired is not None else trend_se(self.gold_se[-len(gold) :], xs) * (hi - lo)
        g_thr = max(self.gold_drop, z * g_se)
        t, nt = self._change(self.train, lo, hi)
        d = self._change(self.diversity, lo, hi)[0] if self.diversity else None
        reasons = []
        rising = nt >= 2 and t > self.train_rise
        if rising and g < -g_thr:
            reasons.append("gold_down")
        # the per-look test at noise_z, reported beside a run-level alarm: sensitive to slow falls, not controlled
        warning = rising and g < -max(self.gold_drop, self.noise_z * g_se)
        if rising and d is not None and self.diversity_drop is not None and d < -self.diversity_drop:
            reasons.append("diversity_down")
        msg = (
            f"iterations {lo}-{hi}: train reward {t:+.4f}, gold {g:+.4f} "
            f"(fall threshold {g_thr:.4f}; noise {z:.3g} x {'paired ' if paired is not None else ''}SE "
            f"{g_se:.4f}{f', look {look} of a run-level alpha {self.alpha:g}' if self.alpha is not None else ''})"
            + (f", diversity {d:+.4f}" if d is not None else "")
            + (f" -> possible reward hacking ({', '.join(reasons)})" if reasons else "")
            + (
                f" -> warning: gold fell by more than {self.noise_z:g} SE (the per-look test; the run-level alarm "
                f"needs {z:.3g})"
                if warning and "gold_down" not in reasons
                else ""
            )
        )
        return AlarmState(
            bool(reasons), t, g, d, reasons, msg, gold_se=g_se, gold_threshold=g_thr, z=z, look=look, warning=warning
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "train": list(self.train),
            "gold": list(self.gold),
            "gold_se": list(self.gold_se),
            "gold_scores": list(self.gold_scores),
            "diversity": list(self.diversity),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train = [tuple(p) for p in state.get("train", [])]
        self.gold = [tuple(p) for p in state.get("gold", [])]
        # checkpoints from before the noise test have neither: their points count as exact (None)
        pad = [None] * len(self.gold)
        self.gold_se = ([None if v is None else float(v) for v in state.get("gold_se", [])] + pad)[: len(pad)]
        self.gold_scores = (
            [None if v is None else [float(x) for x in v] for v in state.get("gold_scores", [])] + pad
        )[: len(pad)]
        self.diversity = [tuple(p) for p in state.get("diversity", [])]
