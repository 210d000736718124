"""The study report from run folders: paired verdicts, budgeted studies, studies without periodic evaluations."""

import json

from flowcredit.compare.report import eval_split, verdict, write_report
from flowcredit.compare.study import Study, StudyRun, run_dir


def _fake_run(d, iters, strict_delta, reward_delta):
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for i in range(1, iters + 1):
            f.write(json.dumps({"iteration": i, "reward_mean": 0.5, "strict_mean": 0.4, "seconds_total": 2.0}) + "\n")
    base = {"reward_mean": 0.5, "strict_overall": 0.4, "strict_by_tag": {"single_object": 0.8}}
    trained = {
        "reward_mean": 0.5 + reward_delta,
        "strict_overall": 0.4 + strict_delta,
        "strict_by_tag": {"single_object": 0.9},
    }
    ev = {"trained": trained, "base": base, "delta": {"reward_mean": reward_delta, "strict_overall": strict_delta}}
    (d / "eval.json").write_text(json.dumps(ev))


def test_verdict_names_a_winner_only_where_the_ci_excludes_zero():
    assert verdict(0.05, 0.02, 3, "nft", "grpo") == "nft better"
    assert verdict(-0.05, 0.02, 3, "nft", "grpo") == "grpo better"
    assert verdict(0.05, 0.06, 3, "nft", "grpo") == "cannot tell"
    assert verdict(0.05, 0.0, 1, "nft", "grpo") == "too few seeds"


def test_budgeted_study_without_periodic_eval_reports_iterations_and_verdicts(tmp_path):
    study = Study(
        name="wall",
        runs=[StudyRun("grpo", "tiny_flow_grpo"), StudyRun("nft", "tiny_nft")],
        seeds=[0, 1, 2],
        iterations=1000,
        eval_every=0,
        overrides=["run.budget_minutes=5.5"],
    )
    # strict: nft beats grpo by 0.10 on every seed (the shared per-seed noise cancels in the pairs); reward: the
    # paired differences +0.06 / −0.03 / +0.01 straddle 0. nft runs more iterations in the same time.
    for s, noise, r in zip(study.seeds, (0.0, 0.01, -0.01), (0.05, -0.04, 0.0)):
        _fake_run(run_dir(tmp_path, study.runs[0], s), 40, 0.02 + noise, 0.01)
        _fake_run(run_dir(tmp_path, study.runs[1], s), 60, 0.12 + noise, 0.02 + r)
    text = write_report(study, tmp_path, "flowcredit compare wall", figure=False).read_text()
    assert "a cap: the runs stop on run.budget_minutes" in text and "no periodic evaluations" in text
    assert "Time to target" not in text and "eval_reward.png" not in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| nft |")}
    assert rows  # final table and paired table
    final = next(line for line in text.splitlines() if line.startswith("| nft | 3 | 0."))
    assert "| 60 | 120 |" in final  # mean iterations run, training seconds
    paired = next(line for line in text.splitlines() if line.startswith("| nft | 3 | +0.1000"))
    assert "nft better; cannot tell" in paired


def test_the_final_table_names_the_prompt_set_the_runs_were_evaluated_on():
    def rec(prompts):
        return {"final": {"trained": {"settings": {"prompts": prompts}}}}

    assert eval_split({"a": [rec("shapes:val")], "b": [rec("shapes:val")]}) == "shapes:val"
    assert eval_split({"a": [rec("shapes:val")], "b": [rec("shapes:test")]}) == "mixed: shapes:test, shapes:val"
    assert eval_split({"a": [{"final": None}]}) == "shapes:test"  # nothing evaluated yet
    assert eval_split({"a": [{"final": {"trained": {}}}]}) == "shapes:test"  # an eval.json without settings
