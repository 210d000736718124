"""Bad inputs and faults through the `flowcredit` command line (docs/RELIABILITY.md lists every case and its test):
each ends in ONE `error: ...` line and a non-zero exit (2: bad input, 3: a fault the run cannot survive), or is
recovered. The cases covered elsewhere (tests/config, tests/cli, tests/shapes, tests/trainer, tests/rewards) are
not repeated here."""

from __future__ import annotations

import errno
import http.server
import json
import sys
import threading
import time

import pytest
import torch

from flowcredit import checkpoints as checkpoint  # the module save() is looked up in (monkeypatched below)
from flowcredit.cli.main import main
from flowcredit.models.tiny import TinyDiTConfig, TinyFlowModel

SMALL = ["model.precision=fp32", "sampler.num_steps=2", "data.prompts_per_iter=2", "data.group_size=2",
         "run.iterations=1", "run.threads=1", "run.eval_prompts=shapes:test_unique", "run.eval_steps=2",
         "run.grid_every=0", "run.eval_at_end=false"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    return TinyFlowModel(TinyDiTConfig(width=32, depth=1, heads=2)).save(tmp_path_factory.mktemp("model"), name="m")


def _small(model_path, tmp_path, *extra):
    return ["train", f"model.path={model_path}", *SMALL, f"run.out_dir={tmp_path / 'run'}", *extra]


def one_error_line(capsys, argv, rc, *fragments) -> str:
    """Run the CLI; assert exit code `rc`, exactly one `error:` line on stderr, no traceback, and the fragments."""
    got = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert got == rc, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    if rc == 2:  # bad input: nothing but the error line
        assert err.strip() == lines[0], err
    return lines[0]


# ------------------------------------------------------------------------------------------------- config files


def test_bad_yaml_syntax_names_file_and_line(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text("method: flow_grpo\nmodel: [unclosed\n")
    one_error_line(capsys, ["train", p], 2, "YAML syntax error", f"{p}:3")


def test_config_that_is_a_list_is_refused(tmp_path, capsys):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    one_error_line(capsys, ["train", p], 2, "must be a mapping", f"{p}:1")


def test_missing_base_preset(tmp_path, capsys):
    p = tmp_path / "child.yaml"
    p.write_text("base: no_such_base\n")
    one_error_line(capsys, ["train", p], 2, "unknown preset 'no_such_base'", f"{p}:1", "tiny_flow_grpo")


def test_missing_base_file(tmp_path, capsys):
    p = tmp_path / "child.yaml"
    p.write_text("base: ./missing_base.yaml\n")
    one_error_line(capsys, ["train", p], 2, "base file './missing_base.yaml'", "not found", "relative to the file")


def test_missing_config_file(tmp_path, capsys):
    one_error_line(capsys, ["train", tmp_path / "nope.yaml"], 2, "nope.yaml' not found", "preset name")


def test_two_presets(capsys):
    one_error_line(capsys, ["train", "tiny_flow_grpo", "tiny_vgpo"], 2, "at most one preset")


def test_resume_of_a_folder_without_config(tmp_path, capsys):
    (tmp_path / "notarun").mkdir()
    one_error_line(capsys, ["train", f"resume={tmp_path / 'notarun'}"], 2, "no config.yaml there")


def test_resume_with_a_preset(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("method: flow_grpo\n")
    one_error_line(capsys, ["train", "tiny_vgpo", f"resume={run}"], 2, "drop tiny_vgpo")


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("run.iterations=-5", ["run.iterations = -5", "override 'run.iterations=-5'", ">= 0"]),
        ("credit.name=vgpoo", ["credit.name", "vgpoo", "did you mean", "vgpo"]),
        ("model.precision=fp16", ["model.precision", "'bf16'"]),
        ("reward.options={nope: 1}", ["reward 'shapes'", "'nope'"]),
        ("reward.name=mix", ["reward.name=mix needs reward.components"]),
    ],
)
def test_bad_values_through_the_cli(tmp_path, capsys, model_path, override, fragments):
    one_error_line(capsys, _small(model_path, tmp_path, override), 2, *fragments)
    assert not (tmp_path / "run").exists()


def test_unknown_logger_through_the_cli(tmp_path, capsys, model_path):
    # one line; NOTE: the run folder is already created when run.loggers is checked (Trainer.setup)
    one_error_line(capsys, _small(model_path, tmp_path, "run.loggers=[mlflow]"), 2, "mlflow", "tensorboard")


# ------------------------------------------------------------------------------------------------- prompt files


def test_plain_text_prompts_with_the_shapes_reward(tmp_path, capsys, model_path):
    p = tmp_path / "plain.txt"
    p.write_text("a photo of a cat\n")
    one_error_line(capsys, _small(model_path, tmp_path, f"data.train_prompts={p}"), 2,
                   "data.train_prompts", "GenEval-schema", "line 1")
    assert not (tmp_path / "run").exists()


def test_malformed_prompt_line_names_file_and_line(tmp_path, capsys, model_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"prompt": "a photo of a red circle", "tag": "single_object",
                             "include": [{"class": "circle", "count": 1}]}) + "\n" + '{"prompt": "a", \n')
    one_error_line(capsys, _small(model_path, tmp_path, f"data.train_prompts={p}"), 2, f"{p}:2", "invalid JSON")


def test_missing_eval_prompts(tmp_path, capsys, model_path):
    argv = _small(model_path, tmp_path, "run.eval_at_end=true", f"run.eval_prompts={tmp_path}/no.jsonl")
    one_error_line(capsys, argv, 2, "run.eval_prompts", "does not exist")
    assert not (tmp_path / "run").exists()


def test_eval_with_a_malformed_prompt_file(tmp_path, capsys, model_path):
    p = tmp_path / "bad.jsonl"
    p.write_text("{not json\n")
    one_error_line(capsys, ["eval", "--checkpoint", model_path, "--prompts", p], 2, f"{p}:1", "invalid JSON")


def test_render_of_a_missing_prompt_file(tmp_path, capsys):
    one_error_line(capsys, ["render", tmp_path / "nope.jsonl", tmp_path / "out"], 2, "does not exist")


# ----------------------------------------------------------------------------------------- files and checkpoints


def test_export_of_missing_weights(tmp_path, capsys):
    one_error_line(capsys, ["export", tmp_path / "nope", tmp_path / "exp"], 2, "not found")


def test_convert_of_a_missing_file(tmp_path, capsys):
    one_error_line(capsys, ["convert", "--trust", tmp_path / "nope.pt"], 2, "nope.pt' not found")


# -------------------------------------------------------------------------------------- output folder and disk


def test_output_folder_that_is_a_file(tmp_path, capsys, model_path):
    f = tmp_path / "run"
    f.write_text("not a folder")
    one_error_line(capsys, _small(model_path, tmp_path), 2, "[Errno 17]", "run.out_dir=", "folder you can write")
    assert f.read_text() == "not a folder"


def test_output_folder_under_a_file_is_unwritable(tmp_path, capsys, model_path):
    (tmp_path / "file").write_text("x")
    argv = ["train", f"model.path={model_path}", *SMALL, f"run.out_dir={tmp_path / 'file' / 'run'}"]
    one_error_line(capsys, argv, 2, "[Errno 20] Not a directory", "folder you can write")


def test_disk_full_at_a_checkpoint_stops_in_one_line_and_resumes(tmp_path, capsys, model_path, monkeypatch):
    real_save, calls = checkpoint.save, []

    def full_disk(state, path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:  # the second checkpoint: the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(state, path, *a, **kw)

    monkeypatch.setattr(checkpoint, "save", full_disk)
    run = tmp_path / "run"
    argv = _small(model_path, tmp_path, "run.iterations=3", "run.checkpoint_every=1")
    line = one_error_line(capsys, argv, 3, "[Errno 28] No space left on device", "iter000002", "after iteration 2",
                          "last complete checkpoint is intact", f"flowcredit train resume={run}")
    assert "Traceback" not in line
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir() if checkpoint.is_checkpoint_dir(p))
    assert ckpts == ["iter000001"] and checkpoint.verify(run / "checkpoints" / "iter000001") is None
    monkeypatch.setattr(checkpoint, "save", real_save)  # space freed: the run continues from iteration 1
    assert main(["train", f"resume={run}"]) == 0
    err = capsys.readouterr().err
    assert "resuming from" in err and "iteration 1" in err
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3


def test_cuda_device_without_cuda(tmp_path, capsys, model_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    one_error_line(capsys, _small(model_path, tmp_path, "run.device=cuda"), 2, "run.device=cuda", "no CUDA device")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------- optional extras


def test_missing_diffusers_extra_prints_the_install_command(tmp_path, capsys, monkeypatch, model_path):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` raises ModuleNotFoundError
    one_error_line(capsys, _small(model_path, tmp_path, "model.name=sd3", "model.path=stabilityai/some-model"), 2,
                   "model.name=sd3 needs the optional extra", 'pip install -e ".[diffusers]"', "'diffusers'")


# ------------------------------------------------------------------------------------------- the reward service


class _Fake(http.server.BaseHTTPRequestHandler):
    mode = "ok"

    def log_message(self, *a):
        pass

    def _send(self, code: int, body: bytes):
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (the slow case)
            pass

    def do_GET(self):
        self._send(200, b'{"batch_dependent": false}')

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.mode == "slow":
            time.sleep(6.0)  # the client gives up after 1 s
            self._send(200, b'{"scores": []}')
        elif self.mode == "garbage":
            self._send(200, b"<html>proxy error</html>")
        elif self.mode == "short":
            self._send(200, b'{"scores": [0.5]}')
        elif self.mode == "500":
            self._send(500, b'{"error": "CUDA out of memory"}')


@pytest.fixture
def fake_service():
    servers = []

    def start(mode):
        handler = type("H", (_Fake,), {"mode": mode})
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def _remote(url, timeout):
    opts = f"{{urls: ['{url}'], max_retries: 0, timeout: {timeout}, backoff: 0}}"
    return ["reward.name=remote", f"reward.options={opts}",
            "faults.reward_retries=1", "faults.reward_backoff=0"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "mode, fragments",
    [
        ("down", ["Connection refused"]),
        ("slow", ["timed out"]),
        ("garbage", ["malformed reward-service response"]),
        ("short", ["returned (1,) scores for a batch of 4"]),
        ("500", ["HTTP 500: CUDA out of memory"]),
    ],
)
def test_reward_service_down_slow_or_malformed_stops_in_one_line(tmp_path, capsys, model_path, fake_service, mode,
                                                                 fragments):
    url = f"http://127.0.0.1:{_free_port()}" if mode == "down" else fake_service(mode)
    timeout = 1.0 if mode == "slow" else 20.0  # generous where the answer must arrive on a loaded machine
    line = one_error_line(capsys, _small(model_path, tmp_path, *_remote(url, timeout)), 3,
                          "reward failed 2 times (faults.reward_retries=1)", url, "last checkpoint is intact",
                          *fragments)
    assert "resume" in line


# ------------------------------------------------------------------------------------------------ memory preflight


def test_batch_too_large_for_memory_fails_before_training(tmp_path, capsys, model_path, monkeypatch):
    from flowcredit.trainer import preflight

    monkeypatch.setattr(preflight, "available_bytes", lambda device: 1e6)
    one_error_line(capsys, _small(model_path, tmp_path), 2, "one iteration needs about", "GB", "is available",
                   "optim.micro_batch", "model.gradient_checkpointing=true")
    assert not (tmp_path / "run").exists()
