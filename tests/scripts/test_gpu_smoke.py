"""scripts/gpu_smoke.py, the first thing to run on a new GPU box: its `--small` version on CPU (the same code as the
real-size run: model folders built from config, one Trainer iteration of grpo and of nft per family, the
preflight's prediction vs the measured memory, seconds per phase, the on-policy ratio, bf16 vs fp32 log-probs) and
its PASS/FAIL logic on made-up results. ≈ 15-20 s on 2 CPU cores."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
assert _spec is not None and _spec.loader is not None
gs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gs)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_smoke")
    code = gs.main(["--small", "--out", str(out), "--work-dir", str(out)])
    return code, json.loads((out / "gpu_smoke.json").read_text()), out


def test_small_run_passes_and_writes_the_report(small_run):
    code, rep, out = small_run
    failed = [c for c in rep["checks"] if c["status"] == "FAIL"]
    assert code == 0 and rep["passed"] and rep["exit_code"] == 0, failed
    assert rep["mode"] == "small" and set(rep["families"]) == {"sd35m", "flux1"}
    names = {c["name"]: c for c in rep["checks"]}
    for fam in ("sd35m", "flux1"):
        fr = rep["families"][fam]
        assert "error" not in fr and set(fr["runs"]) == {"grpo", "nft"}
        for obj in ("grpo", "nft"):
            r = fr["runs"][obj]
            assert {"rollout", "reward", "credit", "update"} <= set(r["seconds"]) and r["seconds_total"] > 0
            m = r["memory"]
            assert m["predicted_peak_gb"] > m["predicted_weights_gb"] > 0 and m["measured_peak_gb"] > 0
            assert r["stats"]["pairs_trained"] > 0 and (Path(r["run_dir"]) / "metrics.jsonl").is_file()
            assert names[f"{fam}/{obj}/memory"]["status"] == "INFO"  # CPU RSS is reported, not asserted
            assert names[f"{fam}/{obj}/update"]["status"] == "PASS"
        # the recipe's settings went through: LoRA r32/α64 (SD3.5-M) and r64/α128 (FLUX.1), CFG 4.5 / none
        assert fr["runs"]["grpo"]["lora"] == ([32, 64.0] if fam == "sd35m" else [64, 128.0])
        assert fr["runs"]["grpo"]["guidance_scale"] == (4.5 if fam == "sd35m" else 1.0)
        assert fr["runs"]["grpo"]["stats"]["ratio_mean"] == 1.0
        assert fr["runs"]["nft"]["stats"]["old_deviate"] == 0.0
        lc = fr["runs"]["grpo"]["logp_check"]
        assert 0 < lc["max_abs_dlogp_bf16_vs_fp32"] <= gs.LOGP_TOL  # bf16 differs from fp32, within the tolerance
        assert lc["max_abs_dlogp_rollout_vs_recomputed"] <= gs.PARITY_TOL
        for c in ("on_policy_ratio", "logp_parity"):
            assert names[f"{fam}/grpo/{c}"]["status"] == "PASS"
        assert names[f"{fam}/logp_bf16_vs_fp32"]["status"] == "PASS"
    assert names["wall_clock"]["status"] == "INFO"
    assert not any(out.glob("flowcredit-gpu-smoke-*")), "the model folders are removed"


def test_failed_checks_give_a_nonzero_exit(small_run):
    _, rep, _ = small_run
    r = copy.deepcopy(rep["families"]["sd35m"]["runs"]["grpo"])
    assert gs.exit_code(gs.evaluate_run("sd35m", "grpo", r, cuda=False)) == 0
    bad = copy.deepcopy(r)
    bad["stats"]["ratio_mean"] = 1.01  # off-policy by numerics: must fail
    assert gs.exit_code(gs.evaluate_run("sd35m", "grpo", bad, cuda=False)) == 1
    bad = copy.deepcopy(r)
    bad["logp_check"]["max_abs_dlogp_bf16_vs_fp32"] = 2 * gs.LOGP_TOL
    assert gs.exit_code(gs.evaluate_run("sd35m", "grpo", bad, cuda=False)) == 1
    bad = copy.deepcopy(r)
    bad["weights_fingerprint"] = [1.0, 1.0]  # the optimizer step moved nothing
    assert gs.exit_code(gs.evaluate_run("sd35m", "grpo", bad, cuda=False)) == 1
    # on CUDA the memory check is asserted: a peak above prediction × margin fails
    over = copy.deepcopy(r)
    over["memory"]["measured_peak_gb"] = over["memory"]["predicted_peak_gb"] * 1.3
    checks = gs.evaluate_run("sd35m", "grpo", over, cuda=True)
    assert [c["status"] for c in checks if c["name"].endswith("/memory")] == ["FAIL"]
    over["memory"]["measured_peak_gb"] = over["memory"]["predicted_peak_gb"] * 1.2
    assert gs.exit_code(gs.evaluate_run("sd35m", "grpo", over, cuda=True)) == 0


def test_real_size_refuses_a_cpu(tmp_path, capsys):
    assert gs.main(["--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
