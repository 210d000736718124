"""The README's "Extending flowcredit" example runs as printed: its python block saved as my_plugins.py in an empty
folder, its bash command run there through the CLI (a subprocess, as a user would), 2 iterations logged."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _example() -> tuple[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Extending flowcredit"):]
    python = re.search(r"```python\n(.*?)```", section, re.S)
    bash = re.search(r"```bash\n(.*?)```", section, re.S)
    assert python and bash and python.start() < bash.start(), "the Extending section: a python block, then a bash one"
    return python.group(1), bash.group(1)


def test_readme_extending_example_runs_as_printed(tmp_path):
    code, command = _example()
    (tmp_path / "my_plugins.py").write_text(code)
    command = " ".join(line.rstrip("\\").strip() for line in command.strip().splitlines())
    assert command.startswith("flowcredit train ") and "run.out_dir=runs/example" in command
    # the console script is `python -m flowcredit.cli.main` of this interpreter; the folder is the user's cwd
    command = command.replace("flowcredit ", f"{sys.executable} -m flowcredit.cli.main ", 1)
    proc = subprocess.run(["bash", "-c", command + " run.threads=1"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "runs" / "example" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"mse"' in lines[0]  # the plugin objective's statistic is logged
    config = (tmp_path / "runs" / "example" / "config.yaml").read_text()
    assert "name: later_steps" in config and "name: rwr" in config  # the resolved config shows what ran
