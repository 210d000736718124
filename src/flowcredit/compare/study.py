"""`flowcredit compare`: run methods × overrides × seeds with a shared iteration budget and shared evaluation
prompts, resumably, then write one report folder.

A study is a YAML file (see `flowcredit/studies/*.yaml`) or a list of presets on the command line:

    flowcredit compare studies/credit.yaml --out docs/results/credit
    flowcredit compare tiny_flow_grpo tiny_stepwise --seeds 0 1 2 --iterations 40 --out results/quick

Every run is `flowcredit train <preset> <overrides> run.seed=<s> run.out_dir=<out>/runs/<name>/seed<s>` in a
subprocess. A run whose `eval.json` exists is finished and skipped; an interrupted run resumes from its latest
checkpoint (the trainer does that by itself), so a study interrupted mid-way resumes without redoing work.

Two savings that do not change any number:
- the runs of a study share `<out>/eval_base_cache/`: arms with the same seed evaluate the initial model once
  (`run.eval_baseline_cache`, keyed by a hash of the initial weights, prompts, noise and settings); before
  time-budgeted runs (run.budget_minutes > 0) the study fills that cache first (`warm_baselines`), so that no arm
  spends part of its budget on it and every arm of a wall-clock study trains for the same time;
- `--reuse DIR`: a run whose fully resolved config (all but `run.out_dir` and the cache folder) equals that of a
  finished run anywhere under DIR (e.g. the same default arm in another study) is copied instead of retrained;
  its `provenance.jsonl` keeps the original commits and command and gains a `reused_from` line, and the report
  lists it. This assumes the code between those commits computes the same thing for that config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

STUDY_DIR = Path(__file__).resolve().parent.parent / "studies"


@dataclass
class StudyRun:
    name: str = field(default="run", metadata={"help": "Label of this arm in the report."})
    preset: str = field(default="tiny_flow_grpo", metadata={"help": "Training preset (or YAML file) of this arm."})
    overrides: list[str] = field(default_factory=list, metadata={"help": "key=value overrides of this arm."})


@dataclass
class Study:
    name: str = field(default="study", metadata={"help": "Study name (report title)."})
    runs: list[StudyRun] = field(default_factory=list, metadata={"help": "The arms: name, preset, overrides."})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Seeds run for every arm."})
    iterations: int = field(default=40, metadata={"help": "Shared iteration budget of every run."})
    eval_every: int = field(default=10, metadata={"help": "Periodic evaluation interval (iterations) on eval_subset "
                                                          "prompts."})
    eval_subset: int = field(
        default=96, metadata={"help": "Tag-balanced held-out prompts of the periodic evaluations."}
    )
    overrides: list[str] = field(default_factory=list, metadata={"help": "key=value overrides applied to every arm."})
    baseline: str | None = field(default=None, metadata={"help": "Arm the ratios refer to; null = the first arm."})
    targets: dict[str, list[float]] = field(
        default_factory=lambda: {"eval_strict": [], "eval_reward": []},
        metadata={
            "help": "Target improvements over the initial model (iteration-0 evaluation) per curve, for the "
            "time-to-target table."
        },
    )
    description: str = field(
        default="", metadata={"help": "What the study tests (which claim of which paper) and its CPU budget."}
    )
    figure_run: str | None = field(
        default=None, metadata={"help": "Arm whose final checkpoint draws the Fig. 1 analogue (a stepwise-type arm)."}
    )

    def __post_init__(self):
        names = [r.name for r in self.runs]
        if len(set(names)) != len(names):
            raise ValueError(f"study run names must be unique, got {names}")
        if self.baseline is not None and self.baseline not in names:
            raise ValueError(f"baseline '{self.baseline}' is not one of the runs {names}")


def load_study(path_or_name: str) -> Study:
    from ..config import load_config

    p = Path(path_or_name)
    if not p.exists() and (STUDY_DIR / f"{path_or_name}.yaml").exists():
        p = STUDY_DIR / f"{path_or_name}.yaml"
    return load_config(Study, str(p), preset_dirs=[STUDY_DIR])


def study_from_presets(
    presets: list[str], seeds: list[int], iterations: int, eval_every: int, overrides: list[str]
) -> Study:
    return Study(
        name="compare " + " vs ".join(presets),
        runs=[StudyRun(name=Path(p).stem, preset=p) for p in presets],
        seeds=seeds,
        iterations=iterations,
        eval_every=eval_every,
        overrides=overrides,
    )


def run_dir(out: Path, run: StudyRun, seed: int) -> Path:
    return out / "runs" / run.name / f"seed{seed}"


def train_command(study: Study, run: StudyRun, seed: int, out: Path, threads: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "flowcredit.cli.main",
        "train",
        run.preset,
        *study.overrides,
        *run.overrides,
        f"run.seed={seed}",
        f"run.iterations={study.iterations}",
        f"run.eval_every={study.eval_every}",
        f"run.eval_subset={study.eval_subset}",
        "run.max_minutes=0",
        f"run.threads={threads}",
        f"run.out_dir={run_dir(out, run, seed)}",
        f"run.eval_baseline_cache={out / 'eval_base_cache'}",
    ]


# resolved-config keys that name folders and do not change what a run computes
_NOT_IDENTITY = ("out_dir", "eval_baseline_cache")


def _identity(cfg) -> dict:
    from ..config.registry import with_full_options

    d = with_full_options(dataclasses.asdict(cfg), type(cfg))  # options written or defaulted count the same
    for k in _NOT_IDENTITY:
        d["run"].pop(k, None)
    if d["model"].get("precision") == "auto":  # a finished run's config.yaml records what 'auto' resolved to here
        from ..models.precision import resolve_precision

        d["model"]["precision"] = resolve_precision("auto", d["run"].get("device", "cpu"))
    return d


def resolved_config(study: Study, run: StudyRun, seed: int, out: Path, threads: int):
    """The TrainConfig `flowcredit train` will resolve for this (arm, seed)."""
    from ..config.resolve import resolve_train_config

    return resolve_train_config(train_command(study, run, seed, out, threads)[4:])[0]


def find_reusable(cfg, pools: list[Path], exclude: Path | None = None) -> Path | None:
    """A finished run folder (has eval.json) under any of `pools` whose resolved config.yaml equals `cfg` in all
    but the folder keys; None if there is none."""
    from ..config import load_config
    from ..config.schema import TrainConfig

    want = _identity(cfg)
    for pool in pools:
        for c in sorted(Path(pool).glob("**/config.yaml")):
            d = c.parent
            if not (d / "eval.json").is_file() or (exclude is not None and d.resolve() == exclude.resolve()):
                continue
            try:
                other = load_config(TrainConfig, str(c))
            except (ValueError, OSError):  # ConfigError: a config of another schema version, not the same run
                continue
            if _identity(other) == want:
                return d
    return None


def reuse_run(src: Path, dst: Path, cfg) -> None:
    """Copy the finished run `src` to `dst`, point its config.yaml at `dst` and record where it came from."""
    from ..config import dump_yaml

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg.run.out_dir = str(dst)
    dump_yaml(cfg, dst / "config.yaml")
    shown = os.path.relpath(src) if Path(src).resolve().is_relative_to(Path.cwd().resolve()) else str(src)
    rec = {"reused_from": shown, "copied_at_commit": git_commit(), "copied": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with open(dst / "provenance.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def reused_from(d: Path) -> str | None:
    """The run folder a reused run was copied from (None if it was trained here)."""
    p = d / "provenance.jsonl"
    if not p.exists():
        return None
    src = [json.loads(line).get("reused_from") for line in p.read_text().splitlines() if line.strip()]
    src = [x for x in src if x]
    return src[-1] if src else None


def git_commit() -> str:
    """HEAD of the repository the running flowcredit code lives in (not the current directory's: a study started
    from elsewhere still records the code it ran), '+dirty' when tracked files differ from it; 'unknown' when the
    package is not in a git checkout (an installed wheel) or git is missing."""
    src = str(Path(__file__).resolve().parent)
    try:
        head = subprocess.check_output(
            ["git", "-C", src, "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
        dirty = subprocess.check_output(
            ["git", "-C", src, "status", "--porcelain", "--untracked-files=no"], text=True, stderr=subprocess.DEVNULL
        ).strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):  # no git, or not a repository
        return "unknown"


def record_provenance(d: Path, cmd: list[str]) -> None:
    """Append which code and command (re)started this run to `<run>/provenance.jsonl` (one line per start)."""
    rec = {"git_commit": git_commit(), "command": " ".join(cmd), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with open(d / "provenance.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def run_commits(d: Path) -> list[str]:
    """The git commits recorded for a run's starts (empty if the run has no provenance record)."""
    p = d / "provenance.jsonl"
    if not p.exists():
        return []
    recs = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return [r["git_commit"] for r in recs if "git_commit" in r]


def _pool(
    jobs: list[Any],
    parallel: int,
    start: Callable[[Any], tuple[subprocess.Popen, IO[str]] | None],
    finished: Callable[[Any, int], None],
    may_start: Callable[[Any, list[Any]], bool] = lambda job, running: True,
    poll_s: float = 1.0,
) -> None:
    """Run `jobs` as subprocesses, at most `parallel` at a time, in order except that a job is passed over while
    `may_start(job, running jobs)` is False. `start(job)` launches one and returns (process, its log file), or None
    when there is nothing to run (e.g. the run was reused); `finished(job, exit code)` is called once it ends (its
    log file closed)."""
    pending = list(jobs)
    running: list[tuple[Any, subprocess.Popen, IO[str]]] = []
    while pending or running:
        while len(running) < parallel:
            busy = [job for job, _, _ in running]
            job = next((j for j in pending if may_start(j, busy)), None)
            if job is None:
                break
            pending.remove(job)
            launched = start(job)
            if launched is not None:
                running.append((job, *launched))
        if running:
            time.sleep(poll_s)
        for item in list(running):
            job, proc, log_file = item
            if proc.poll() is not None:
                running.remove(item)
                log_file.close()
                finished(job, proc.returncode)


def warm_baselines(
    study: Study, out: Path, todo: list[tuple[StudyRun, int]], parallel: int, threads: int, log=print
) -> None:
    """Before time-budgeted runs (run.budget_minutes > 0) that evaluate the initial model, fill the study's baseline
    cache (`flowcredit train --warm-baseline`, one process per (arm, seed), `parallel` at a time, logs under
    <out>/warm/). Otherwise the first arm of a seed to finish would evaluate the initial model inside its own budget
    (≈ 65 s of 5.5 minutes for the shapes test split on one core) and the arms after it, reading the cache, would
    train that much longer. Arms that share an initial model and seed share one cache file; a warm-up that finds it
    there costs only its setup. The cache is keyed per seed, so two warm-ups of one seed never run at once (both
    would evaluate a shared initial model): another seed's warm-up goes first."""
    need = []
    for r, s in todo:
        rc = resolved_config(study, r, s, out, threads).run
        if rc.budget_minutes > 0 and rc.eval_baseline and rc.eval_at_end:
            need.append((r, s))
    if not need:
        return
    log(f"warming the initial model's evaluation for {len(need)} budgeted runs before they start")

    def warm_dir(job: tuple[StudyRun, int]) -> Path:
        return out / "warm" / job[0].name / f"seed{job[1]}"

    def start(job: tuple[StudyRun, int]) -> tuple[subprocess.Popen, IO[str]]:
        r, s = job
        d = warm_dir(job)
        d.mkdir(parents=True, exist_ok=True)
        cmd = [
            f"run.out_dir={d}" if c.startswith("run.out_dir=") else c for c in train_command(study, r, s, out, threads)
        ]
        f = open(d / "warm.log", "a")
        return subprocess.Popen([*cmd, "--warm-baseline"], stdout=f, stderr=subprocess.STDOUT), f

    def finished(job: tuple[StudyRun, int], code: int) -> None:
        if code != 0:  # the run itself will then evaluate the baseline (and report the problem)
            d = warm_dir(job)
            log(f"warm-up in {d} failed (exit {code}); see {d / 'warm.log'}")

    _pool(need, parallel, start, finished, may_start=lambda job, busy: all(s != job[1] for _, s in busy), poll_s=0.5)


def execute(
    study: Study, out: Path, parallel: int = 1, threads: int = 0, log=print, reuse: list[Path] | None = None
) -> list[tuple[str, int]]:
    """Run every (arm, seed) not finished yet; `parallel` subprocesses at a time. Returns (run, exit code) list.
    With `reuse` folders, a not-yet-started run identical to a finished one there is copied (exit code 0)."""
    out.mkdir(parents=True, exist_ok=True)
    threads = threads or max(1, (os.cpu_count() or 2) // max(1, parallel))
    # seed-major: a study stopped part-way has every arm of its first seeds, which pair with each other
    todo = [(r, s) for s in study.seeds for r in study.runs if not (run_dir(out, r, s) / "eval.json").exists()]
    done = len(study.runs) * len(study.seeds) - len(todo)
    results: list[tuple[str, int]] = []

    def try_reuse(r: StudyRun, s: int) -> bool:
        d = run_dir(out, r, s)
        if not reuse or (d / "metrics.jsonl").exists():  # started here: resume it rather than replace it
            return False
        cfg = resolved_config(study, r, s, out, threads)
        src = find_reusable(cfg, reuse, exclude=d)
        if src is None:
            return False
        reuse_run(src, d, cfg)
        results.append((f"{r.name}/seed{s}", 0))
        log(f"reused {r.name} seed {s} from {src} (identical resolved config)")
        return True

    todo = [(r, s) for r, s in todo if not try_reuse(r, s)]
    log(
        f"study '{study.name}': {done} runs finished, {len(results)} reused, {len(todo)} to run ({parallel} at a time)"
    )
    warm_baselines(study, out, todo, parallel, threads, log)

    def start(job: tuple[StudyRun, int]) -> tuple[subprocess.Popen, IO[str]] | None:
        r, s = job
        if try_reuse(r, s):  # finished meanwhile in a reuse folder (e.g. a study running beside this one)
            return None
        d = run_dir(out, r, s)
        d.mkdir(parents=True, exist_ok=True)
        cmd = train_command(study, r, s, out, threads)
        f = open(d / "train.log", "a")
        record_provenance(d, cmd)
        log(f"start {r.name} seed {s}")
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT), f

    def finished(job: tuple[StudyRun, int], code: int) -> None:
        r, s = job
        results.append((f"{r.name}/seed{s}", code))
        see = "" if code == 0 else f"; see {run_dir(out, r, s) / 'train.log'}"
        log(f"finished {r.name}/seed{s} (exit {code}){see}")

    _pool(todo, parallel, start, finished)
    return results
