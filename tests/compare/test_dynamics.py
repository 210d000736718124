"""The training-dynamics table of a study report, on hand-made metrics with hand-computed cells."""

from flowcredit.compare.dynamics import dynamics_table


def test_dynamics_table_summarises_each_arms_training_over_seeds():
    def rows(kl, fm0, fm1):  # 30 iterations: fm_mse steps from fm0 to fm1 at iteration 15
        return [{"kl": kl, "fm_mse": fm0 if i < 15 else fm1, "reward_mean": 0.5} for i in range(30)]

    runs = {
        "a": [{"metrics": rows(0.01, 0.1, 0.2)}, {"metrics": rows(0.03, 0.1, 0.4)}],
        "b": [{"metrics": [{"reward_mean": 0.4}]}],  # no kl / fm_mse logged
    }
    lines = dynamics_table(runs, window=10)
    header = next(line for line in lines if line.startswith("| arm |"))
    assert "KL to the reference, last 10" in header and "advantage" not in header  # only logged keys
    a = next(line for line in lines if line.startswith("| a |")).split("|")[2:-1]
    assert [c.strip() for c in a] == ["0.0200", "0.100 → 0.300", "0.500 → 0.500"]
    b = next(line for line in lines if line.startswith("| b |")).split("|")[2:-1]
    assert [c.strip() for c in b] == ["–", "–", "0.400 → 0.400"]
    assert dynamics_table({"c": [{"metrics": [{"iteration": 1}]}]}) == []
