"""Plugins from the command line: run.plugins=[module] imports a module that registers components before the config
is checked, and credit.name=package.module:function works without a second key; from a temp folder, through the CLI
in a subprocess; bad plugins are one error line."""

from __future__ import annotations

import subprocess
import sys

CHEAP = ["run.iterations=1", "run.eval_at_end=false", "run.eval_baseline=false", "run.grid_every=0", "run.threads=1",
         "run.checkpoint_every=0", "run.budget_minutes=0", "data.prompts_per_iter=2", "data.group_size=2",
         "sampler.num_steps=3", "run.out_dir=out"]

PLUGIN = '''
from dataclasses import dataclass, field
from flowcredit.credit.base import CreditOutput
from flowcredit.credit.registry import register_credit


@dataclass
class Opts:
    scale: float = field(default=1.0, metadata={"help": "advantage scale", "gt": 0})


def centred(inp, opts, cfg):
    r = inp.rewards - inp.rewards.mean()
    return CreditOutput(advantages=opts.scale * r[:, None].expand(-1, inp.num_steps).clone(), stats={}, state={})


register_credit("centred", centred, Opts)
'''


def _train(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "flowcredit.cli.main", "train", *args, *CHEAP], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_run_plugins_registers_a_credit_method_from_the_folder_you_run_from(tmp_path):
    (tmp_path / "my_credit.py").write_text(PLUGIN)
    proc = _train(tmp_path, "run.plugins=[my_credit]", "credit.name=centred", "credit.options.scale=2.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out" / "metrics.jsonl").read_text().count("\n") == 1
    assert "name: centred" in (tmp_path / "out" / "config.yaml").read_text()


def test_a_credit_path_works_without_a_second_key(tmp_path):
    (tmp_path / "my_credit.py").write_text(PLUGIN)  # the module registers `centred` when imported
    proc = _train(tmp_path, "credit.name=my_credit:centred")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_plugin_option_is_checked_like_any_key(tmp_path):
    (tmp_path / "my_credit.py").write_text(PLUGIN)
    proc = _train(tmp_path, "run.plugins=[my_credit]", "credit.name=centred", "credit.options.scale=0")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and "credit.options.scale" in proc.stderr and "> 0" in proc.stderr


def test_a_missing_plugin_module_is_one_line(tmp_path):
    proc = _train(tmp_path, "run.plugins=[no_such_plugin]")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: run.plugins: cannot import 'no_such_plugin'")
    assert "in the folder you run from or on PYTHONPATH" in proc.stderr
    assert not (tmp_path / "out").exists()
