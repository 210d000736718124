"""`flowcredit compare`: a study runs arms × seeds, resumes without redoing finished runs, and writes a report."""

import json

from flowcredit.compare.report import write_report
from flowcredit.compare.study import (
    Study, StudyRun, execute, find_reusable, git_commit, resolved_config, reused_from, run_commits, run_dir,
)
from flowcredit.models.tiny import TinyDiTConfig, TinyFlowModel


def _study(model_path, tmp_path):
    tiny = [
        f"model.path={model_path}", "model.precision=fp32", "data.prompts_per_iter=2", "data.group_size=2",
        "sampler.num_steps=2", "run.eval_prompts=shapes:test_unique", "run.eval_steps=2", "run.grid_every=0",
        "estimate.substeps=1", "run.checkpoint_every=1",
    ]
    return Study(
        name="tiny", runs=[StudyRun("fg", "tiny_flow_grpo"), StudyRun("sw", "tiny_stepwise")], seeds=[0],
        iterations=2, eval_every=1, eval_subset=6, overrides=tiny, targets={"eval_reward": [0.0]}, figure_run="sw",
    )


def test_study_runs_resumes_and_reports(tmp_path):
    TinyFlowModel(TinyDiTConfig(width=32, depth=1, heads=2)).save(tmp_path, name="m")
    out = tmp_path / "study"
    study = _study(tmp_path / "m.safetensors", tmp_path)
    # simulate an interruption: only the first arm ran before the "crash"
    partial = Study(**{**study.__dict__, "runs": study.runs[:1]})
    res = execute(partial, out, parallel=1, threads=1, log=lambda *_: None)
    assert res == [("fg/seed0", 0)]
    done = run_dir(out, study.runs[0], 0)
    stamp = (done / "eval.json").stat().st_mtime_ns
    lines = (done / "metrics.jsonl").read_text()
    res = execute(study, out, parallel=2, threads=1, log=lambda *_: None)
    assert res == [("sw/seed0", 0)]  # the finished run is not redone
    assert (done / "eval.json").stat().st_mtime_ns == stamp and (done / "metrics.jsonl").read_text() == lines
    path = write_report(study, out, "flowcredit compare test")
    text = path.read_text()
    assert "git commit" in text and "flowcredit compare test" in text
    # provenance: each run records the code and command it was (re)started with, and the report lists them
    assert run_commits(done) == [git_commit()] and run_commits(run_dir(out, study.runs[1], 0)) == [git_commit()]
    rec = json.loads((done / "provenance.jsonl").read_text())
    assert "flowcredit" in rec["command"] and "run.iterations=2" in rec["command"]
    assert f"trained at: `{git_commit()}` (2 runs)" in text
    assert "| fg | 1 |" in text and "| sw | 1 |" in text
    assert "Paired by seed against **fg**" in text and "| arm | paired seeds |" in text
    assert (out / "curves.png").exists() and (out / "gain_per_step.png").exists()
    assert "## Credit diagnostics" in text and (out / "diagnostics.png").exists()
    assert any(line.startswith("| fg | ") and line.count("|") == 3 for line in text.splitlines())  # zero-std column
    ev = json.loads((run_dir(out, study.runs[1], 0) / "eval.json").read_text())
    assert "delta" in ev
    # both arms share seed 0 and the presets' time budget is on (run.budget_minutes), so the study evaluated the
    # initial model once before the runs (warm-up of the first arm) and both read it from the cache
    ev_fg = json.loads((done / "eval.json").read_text())
    assert "base_cached" in ev_fg and "base_cached" in ev and ev["base"] == ev_fg["base"]
    assert not (run_dir(out, study.runs[1], 0) / "eval_base").exists() and not (done / "eval_base").exists()
    assert (out / "warm" / "fg" / "seed0" / "eval_base").exists()

    # --reuse: an arm whose resolved config equals a finished run's (another name, another study) is copied
    again = Study(**{**study.__dict__, "name": "again", "runs": [StudyRun("fg_again", "tiny_flow_grpo")], "figure_run": None})
    out2 = tmp_path / "study2"
    res = execute(again, out2, parallel=1, threads=1, log=lambda *_: None, reuse=[out])
    copied = run_dir(out2, again.runs[0], 0)
    assert res == [("fg_again/seed0", 0)]
    assert (copied / "eval.json").read_text() == (done / "eval.json").read_text()
    assert (copied / "metrics.jsonl").read_text() == lines
    assert reused_from(copied) == str(done) and run_commits(copied) == run_commits(done)  # trained-at commits kept
    from flowcredit.config import load_config
    from flowcredit.config.schema import TrainConfig

    assert load_config(TrainConfig, str(copied / "config.yaml")).run.out_dir == str(copied)
    assert "reused, not retrained" in write_report(again, out2, "flowcredit compare again").read_text()
    # a different config (learning rate) is not reused
    other = StudyRun("fg_lr", "tiny_flow_grpo", ["optim.lr=1e-4"])
    assert find_reusable(resolved_config(again, other, 0, out2, 1), [out]) is None
    assert find_reusable(resolved_config(again, again.runs[0], 0, out2, 1), [out]) == done


def test_every_shipped_study_resolves_to_valid_train_configs():
    """Each studies/*.yaml loads, and every arm's preset + study overrides + arm overrides is a valid TrainConfig."""
    from flowcredit.cli.main import PRESET_DIR
    from flowcredit.compare.study import STUDY_DIR, load_study
    from flowcredit.config import load_config
    from flowcredit.config.schema import TrainConfig

    names = sorted(p.stem for p in STUDY_DIR.glob("*.yaml"))
    assert {"credit", "normalization", "substeps", "sde", "stagnation", "stepwise_budget"} <= set(names)
    for name in names:
        study = load_study(name)
        assert study.runs and study.seeds and study.description, name
        for r in study.runs:
            cfg = load_config(TrainConfig, r.preset, [*study.overrides, *r.overrides, f"run.iterations={study.iterations}"],
                              preset_dirs=[PRESET_DIR])
            assert cfg.run.iterations == study.iterations, (name, r.name)


def test_identity_treats_auto_precision_as_what_it_resolves_to():
    # a finished run's config.yaml records 'bf16'/'fp32' where the study's resolved config still says 'auto'
    from flowcredit.compare.study import _identity
    from flowcredit.config.schema import TrainConfig
    from flowcredit.models.precision import resolve_precision

    auto, resolved = TrainConfig(), TrainConfig()
    auto.model.precision = "auto"
    resolved.model.precision = resolve_precision("auto", "cpu")
    assert _identity(auto) == _identity(resolved)
    other = TrainConfig()
    other.model.precision = "fp32" if resolved.model.precision == "bf16" else "bf16"
    assert _identity(auto) != _identity(other)


def test_git_commit_is_the_code_s_repository_not_the_current_directory(tmp_path, monkeypatch):
    """A study started outside the checkout (e.g. from a scratch folder) still records which code ran."""
    inside = git_commit()
    monkeypatch.chdir(tmp_path)  # not a git repository
    assert git_commit() == inside


def test_execute_reuses_a_run_that_finished_after_the_study_started(tmp_path, monkeypatch):
    """--reuse is checked again when a run's turn comes: a study beside this one may have finished it meanwhile."""
    import flowcredit.compare.study as st

    copied = []
    answers = iter([None, tmp_path / "other" / "seed0"])  # at the start: not finished yet; at launch: finished
    monkeypatch.setattr(st, "resolved_config", lambda *a, **k: object())
    monkeypatch.setattr(st, "find_reusable", lambda cfg, pools, exclude=None: next(answers))
    monkeypatch.setattr(st, "reuse_run", lambda src, dst, cfg: copied.append((src, dst)))
    monkeypatch.setattr(st, "warm_baselines", lambda *a, **k: None)  # (reads the stubbed config's run section)
    study = Study(name="x", runs=[StudyRun("a", "tiny_nft")], seeds=[0], iterations=1)
    res = st.execute(study, tmp_path / "out", reuse=[tmp_path / "other"], log=lambda *_: None)
    assert res == [("a/seed0", 0)]  # no training subprocess was started
    assert copied == [(tmp_path / "other" / "seed0", run_dir(tmp_path / "out", study.runs[0], 0))]


def test_budgeted_runs_find_the_initial_model_evaluated_before_they_start(tmp_path):
    """With run.budget_minutes > 0 the study fills the baseline cache first (`train --warm-baseline`), so every arm,
    not only those after the first of its seed, reads the initial model's evaluation instead of paying for it
    inside its own time budget."""
    TinyFlowModel(TinyDiTConfig(width=32, depth=1, heads=2)).save(tmp_path, name="m")
    out = tmp_path / "study"
    base = _study(tmp_path / "m.safetensors", tmp_path)
    study = Study(**{**base.__dict__, "overrides": [*base.overrides, "run.eval_baseline=true",
                                                    "run.budget_minutes=30", "run.checkpoint_every=0"],
                     "eval_every": 0, "figure_run": None})
    logs: list[str] = []
    # two at a time: the runs train side by side, but the two warm-ups of seed 0 run one after the other, so the
    # second finds the first's evaluation in the cache instead of computing it at the same time
    res = execute(study, out, parallel=2, threads=1, log=logs.append)
    assert sorted(res) == [("fg/seed0", 0), ("sw/seed0", 0)]
    assert any("warming the initial model's evaluation for 2 budgeted runs" in m for m in logs)
    cached = list((out / "eval_base_cache").glob("*.json"))
    assert len(cached) == 1  # both arms evaluate the same initial model on the same prompts and noise
    for r in study.runs:
        ev = json.loads((run_dir(out, r, 0) / "eval.json").read_text())
        assert ev["base_cached"] == str(cached[0]) and not (run_dir(out, r, 0) / "eval_base").exists()
    assert (out / "warm" / "fg" / "seed0" / "eval_base").exists()  # the warm-up of the first arm evaluated it
    assert not (out / "warm" / "sw" / "seed0" / "eval_base").exists()  # the second found it in the cache


def test_warm_baseline_without_a_cache_folder_is_a_one_line_error(tmp_path, capsys):
    from flowcredit.cli.main import main

    TinyFlowModel(TinyDiTConfig(width=32, depth=1, heads=2)).save(tmp_path, name="m")
    rc = main(["train", f"model.path={tmp_path / 'm.safetensors'}", "model.precision=fp32",
               f"run.out_dir={tmp_path / 'run'}", "run.eval_baseline=true", "--warm-baseline"])
    err = capsys.readouterr().err
    assert rc != 0 and "--warm-baseline needs" in err and "run.eval_baseline_cache=FOLDER" in err


def test_pool_runs_in_order_and_passes_over_jobs_that_may_not_start_yet(tmp_path):
    """The subprocess pool shared by the warm-ups and the runs: at most `parallel` at a time, a job is passed over
    while `may_start` says no (the warm-ups: never two of one seed at once), a None from `start` is skipped."""
    import subprocess
    import sys

    from flowcredit.compare.study import _pool

    started, ended, overlap = [], [], []

    def start(job):
        if job == ("skip", 9):
            return None
        busy_seeds = [j[1] for j in started if j not in [e for e, _ in ended]]
        overlap.append(job[1] in busy_seeds)
        started.append(job)
        f = open(tmp_path / f"{job[0]}{job[1]}.log", "w")
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"], stdout=f), f

    jobs = [("a", 0), ("b", 0), ("skip", 9), ("a", 1), ("b", 1)]
    _pool(jobs, 2, start, lambda job, code: ended.append((job, code)),
          may_start=lambda job, busy: all(s != job[1] for _, s in busy), poll_s=0.05)
    assert started[:2] == [("a", 0), ("a", 1)]  # ("b", 0) waits for ("a", 0); seed 1 goes first
    assert sorted(started) == sorted(j for j in jobs if j != ("skip", 9)) and not any(overlap)
    assert sorted(ended) == sorted((j, 0) for j in started)
