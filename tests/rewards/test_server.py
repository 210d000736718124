"""The reward service: round-trip scores identical to in-process scoring (shapes verifier on rendered ground truth),
refusal of pickle / oversized / malformed / unauthenticated requests with a 4xx and a reason, batching of concurrent
requests, and the `remote` client's load balancing and failover over several URLs."""

from __future__ import annotations

import http.client
import json
import pickle
import time

import numpy as np
import pytest
import torch

from flowcredit.rewards.registry import build_reward
from flowcredit.rewards.remote import RemoteReward, RemoteRewardError, RewardInputError
from flowcredit.rewards.server import RewardServer, main_serve, serve_reward
from flowcredit.rewards.wire import SCHEMA, encode_request


@pytest.fixture(scope="module")
def gt_batch():
    """Ground-truth renders of 6 test prompts (strict reward 1) plus 2 mismatched pairs (reward < 1)."""
    from flowcredit.shapes.prompts import make_splits
    from flowcredit.shapes.render import render_record

    recs = make_splits()["test"][:6]
    imgs = [render_record(r, seed=0, index=i) for i, r in enumerate(recs)]
    recs = recs + [recs[0], recs[1]]
    imgs = imgs + [imgs[1], imgs[0]]
    x = torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float() / 255.0
    return x, [r["prompt"] for r in recs], recs


@pytest.fixture(scope="module")
def shapes_server():
    srv = serve_reward("shapes", port=0, token="s3cret", block=False, max_body_bytes=200_000)
    yield srv
    srv.close()


def _post(url, body: bytes, headers: dict[str, str], path="/score"):
    host, port = url.split("//")[1].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.request("POST", path, body=body, headers=headers)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, json.loads(data) if data else {}


AUTH = {"Authorization": "Bearer s3cret", "Content-Type": "application/json"}


@pytest.mark.parametrize("encoding", ["png", "safetensors"])
def test_round_trip_identical_to_in_process(shapes_server, gt_batch, encoding):
    x, prompts, meta = gt_batch
    local = build_reward("shapes")(x, prompts, meta)
    assert local.scores[:6].tolist() == [1.0] * 6 and local.scores[6:].max() < 1
    remote = build_reward("remote", urls=[shapes_server.url], token="s3cret", encoding=encoding)
    out = remote(x, prompts, meta)
    assert torch.equal(out.scores, local.scores)
    assert out.components.keys() == local.components.keys()
    for k in local.components:
        assert torch.equal(out.components[k], local.components[k])
    assert out.info["reasons"] == local.info["reasons"]
    assert [r.strict for r in out.info["results"]] == [r.strict for r in local.info["results"]]  # attribute access
    assert shapes_server.url.startswith("http://127.0.0.1:")  # loopback by default


def test_refuses_pickle_oversized_malformed_and_unauthenticated(shapes_server, gt_batch):
    x, prompts, meta = gt_batch
    url = shapes_server.url
    good = encode_request(x[:2], prompts[:2], meta[:2])
    pk = pickle.dumps({"images": [b"..."], "meta_datas": meta[:2], "only_strict": True})  # flow_grpo's format
    cases = [
        (pk, {"Authorization": "Bearer s3cret", "Content-Type": "application/octet-stream"}, 400, "pickle"),
        (pk, AUTH, 400, "pickle"),
        (b"x" * 300_000, AUTH, 413, "max_body_bytes"),
        (b"{not json", AUTH, 400, "not JSON"),
        (good, {"Content-Type": "application/json"}, 401, "token"),
        (good, {"Authorization": "Bearer wrong", "Content-Type": "application/json"}, 401, "token"),
        (good, {"Authorization": "Bearer s3cret", "Content-Type": "text/plain"}, 415, "application/json"),
        (json.dumps({"images": {"encoding": "png", "data": ["!!"]}, "prompts": ["a"]}).encode(), AUTH, 400, "base64"),
        (json.dumps({"images": {"encoding": "jpeg", "data": []}, "prompts": []}).encode(), AUTH, 422, "encoding"),
        (json.dumps({"images": {"encoding": "png", "data": json.loads(good)["images"]["data"]}, "prompts": ["a"]}).encode(), AUTH, 422, "prompts"),
        (json.dumps({**json.loads(good), "exec": "rm -rf"}).encode(), AUTH, 422, "unknown keys"),
        (json.dumps({**json.loads(good), "schema": "other"}).encode(), AUTH, 422, "schema"),
    ]
    for body, headers, code, fragment in cases:
        status, resp = _post(url, body, headers)
        assert status == code, (fragment, status, resp)
        assert fragment in resp["error"] and resp["status"] == code, resp
    # a huge declared length is refused before reading the body
    host, port = url.split("//")[1].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.putrequest("POST", "/score")
    c.putheader("Content-Length", str(10**12))
    c.putheader("Authorization", "Bearer s3cret")
    c.endheaders()
    r = c.getresponse()
    assert r.status == 413 and "max_body_bytes" in json.loads(r.read())["error"]
    c.close()
    # shapes without metadata → the reward raises ValueError → 422 with its reason; the server keeps serving
    body = encode_request(x[:1], prompts[:1], [{}])
    status, resp = _post(url, body, AUTH)
    assert status == 422 and "reward 'shapes' cannot score this input" in resp["error"], resp
    assert "GenEval-schema metadata" in resp["error"]
    status, resp = _post(url, good, AUTH)
    assert status == 200 and resp["schema"] == SCHEMA and len(resp["scores"]) == 2
    # health is open and says what is served
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.request("GET", "/health")
    h = json.loads(c.getresponse().read())
    assert h["status"] == "ok" and h["reward"] == "shapes"


def test_concurrent_requests_are_batched_and_correct(gt_batch):
    x, prompts, meta = gt_batch
    calls = []
    inner = build_reward("shapes")

    def counting(images, p, m, **kw):
        calls.append(images.shape[0])
        return inner(images, p, m)

    counting.name = "shapes"
    srv = RewardServer(counting, batch_wait_s=0.2).start()
    try:
        client = build_reward("remote", urls=srv.url, chunk_size=1, max_concurrency=8)  # 8 concurrent 1-image requests
        out = client(x, prompts, meta)
        assert torch.equal(out.scores, inner(x, prompts, meta).scores)
        assert sum(calls) == 8 and len(calls) < 8  # merged into fewer reward calls
    finally:
        srv.close()


def test_remote_load_balances_and_fails_over(gt_batch):
    x, prompts, meta = gt_batch
    a = serve_reward("shapes", port=0, block=False)
    b = serve_reward("shapes", port=0, block=False)
    dead = "http://127.0.0.1:9"  # discard port: connection refused
    try:
        r = build_reward("remote", urls=[a.url, b.url], backoff=0.01)
        ref = build_reward("shapes")(x, prompts, meta).scores
        assert torch.equal(r(x, prompts, meta).scores, ref)
        assert r.requests_per_url[a.url] >= 1 and r.requests_per_url[b.url] >= 1
        r2 = build_reward("remote", urls=[dead, a.url], backoff=0.01)
        assert torch.equal(r2(x, prompts, meta).scores, ref)  # the dead server's chunk went to the live one
        r3 = build_reward("remote", urls=[dead], max_retries=1, backoff=0.01, timeout=2)
        with pytest.raises(RemoteRewardError, match="no reward server could score.*127.0.0.1:9"):
            r3(x, prompts, meta)
        r4 = build_reward("remote", urls=[a.url], token="unexpected-but-harmless")
        r4(x[:1], prompts[:1], meta[:1])
    finally:
        a.close()
        b.close()


def test_remote_4xx_is_raised_with_reason(shapes_server, gt_batch):
    x, prompts, meta = gt_batch
    r = build_reward("remote", urls=[shapes_server.url], token="wrong", backoff=5.0)
    with pytest.raises(RewardInputError, match="HTTP 401: missing or wrong bearer token") as ei:
        r(x[:1], prompts[:1], meta[:1])
    assert ei.value.status == 401 and str(ei.value).startswith(f"reward service {shapes_server.url} refused the")
    assert r.requests_per_url[shapes_server.url] == 2  # GET /health + one POST /score: not retried


def test_unscorable_input_is_422_and_raised_at_once(gt_batch):
    """A 20x20 image to `shapes` (the reward raises ValueError: resolution 20 is not supported) is answered 422 with
    the reason; the client raises RewardInputError after ONE request: no backoff, no retry round, no other URL."""
    x, prompts, meta = gt_batch
    a = serve_reward("shapes", port=0, block=False)
    b = serve_reward("shapes", port=0, block=False)
    try:
        small = torch.rand(1, 3, 20, 20, generator=torch.Generator().manual_seed(0))
        status, resp = _post(a.url, encode_request(small, prompts[:1], meta[:1]), {"Content-Type": "application/json"})
        assert status == 422 and resp["status"] == 422, resp
        assert resp["error"] == ("reward 'shapes' cannot score this input: shapes world resolution 20 is not "
                                 "supported; use one of [32, 64]")
        assert a.requests == 1 and a.served == 0
        r = build_reward("remote", urls=[a.url, b.url], max_retries=2, backoff=5.0)  # a retry would sleep 5 s
        t0 = time.monotonic()
        with pytest.raises(RewardInputError) as ei:
            r(small, prompts[:1], meta[:1])
        elapsed = time.monotonic() - t0
        e = ei.value
        assert isinstance(e, ValueError) and isinstance(e, RemoteRewardError) and e.status == 422 and e.url == a.url
        assert str(e) == (f"reward service {a.url} refused the request: HTTP 422: reward 'shapes' cannot score this "
                          "input: shapes world resolution 20 is not supported; use one of [32, 64]")
        assert "\n" not in str(e) and e.reason.endswith("use one of [32, 64]")
        assert (a.requests, b.requests) == (2, 0)  # the one above + one from the client; the other URL untouched
        assert r.requests_per_url == {a.url: 2, b.url: 0}  # GET /health + one POST /score
        assert elapsed < 2.5, elapsed
        # the server keeps serving, and good input through the same client still scores
        ref = build_reward("shapes")(x[:2], prompts[:2], meta[:2]).scores
        assert torch.equal(r(x[:2], prompts[:2], meta[:2]).scores, ref)
    finally:
        a.close()
        b.close()


def test_reward_fault_is_500_and_retried():
    """Any other exception of the reward is a server fault: 500 with its reason (on one line), retried every round."""
    calls = []

    def oom(images, p, m, **kw):
        calls.append(images.shape[0])
        raise RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB")

    oom.name = "oom"
    srv = RewardServer(oom).start()
    try:
        r = build_reward("remote", urls=srv.url, max_retries=2, backoff=0.01)
        with pytest.raises(RemoteRewardError) as ei:
            r(torch.rand(2, 3, 8, 8), ["a", "b"], [{}, {}])
        assert not isinstance(ei.value, ValueError)
        assert str(ei.value) == (f"no reward server could score 2 images after 3 rounds: {srv.url}: HTTP 500: reward "
                                 "'oom' failed: RuntimeError: CUDA out of memory. Tried to allocate 2 GiB")
        assert srv.requests == 3 and calls == [2, 2, 2]
    finally:
        srv.close()


class _Silent:
    """A TCP server that accepts connections, reads what the client sends (`lines`: the first line of each) and
    never answers."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.lines: list[str] = []
        self.conns: list = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            c.settimeout(2.0)
            try:
                self.lines.append(c.recv(1 << 16).split(b"\r\n", 1)[0].decode())
            except OSError:
                self.lines.append("")

    def requests(self) -> list[str]:
        time.sleep(0.1)  # let the accept thread read the last request line
        return [ln.split(" HTTP")[0] for ln in self.lines]

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def test_silent_server_fails_within_the_deadline():
    """`timeout` bounds the whole call: the /health probe, the tries and the backoff. A server that accepts and never
    answers fails a call within timeout (plus scheduling slack), not health + timeout x rounds (0.5 + 3 x 0.5 s
    here); the probe that timed out is not repeated by the next call."""
    timeout, slack = 0.5, 0.6
    within = r"no reward server could score 1 images within timeout=0\.5 s \(the deadline of one call"
    silent = _Silent()
    try:
        r = RemoteReward(urls=[silent.url], timeout=timeout, max_retries=2, backoff=0.05)
        x = torch.rand(1, 3, 8, 8)
        for call in range(2):
            t0 = time.monotonic()
            with pytest.raises(RemoteRewardError, match=within) as ei:
                r(x, ["a"], [{}])
            elapsed = time.monotonic() - t0
            assert elapsed < timeout + slack, (call, elapsed)
            assert not isinstance(ei.value, ValueError) and "\n" not in str(ei.value)
            if call == 0:  # the probe took the whole deadline: no /score was sent
                assert f"{silent.url}: not tried, no time left (its GET /health timed out)" in str(ei.value)
            else:  # not probed again: the /score request timed out
                assert f"{silent.url}: TimeoutError: timed out" in str(ei.value), str(ei.value)
        assert silent.requests() == ["GET /health", "POST /score"]
    finally:
        silent.close()


def test_silent_server_among_live_ones_is_tried_last():
    """urls=[silent, live]: the first call fails within its deadline (the probe of the silent URL took it); the next
    call (what the trainer's retry does) skips that probe and sends every chunk to the live server first."""
    timeout = 2.0  # the live server must answer within it on a loaded machine
    silent = _Silent()
    live = serve_reward("imagestats", port=0, block=False, options={"stat": "brightness"})
    try:
        r = RemoteReward(urls=[silent.url, live.url], timeout=timeout, max_retries=1, backoff=0.01)
        x = torch.full((2, 3, 8, 8), 0.25)
        t0 = time.monotonic()
        with pytest.raises(RemoteRewardError, match="within timeout=2 s"):
            r(x, ["a", "b"], [{}, {}])
        assert time.monotonic() - t0 < timeout + 0.6
        t0 = time.monotonic()
        out = r(x, ["a", "b"], [{}, {}])
        assert time.monotonic() - t0 < timeout and torch.allclose(out.scores, torch.full((2,), 0.25), atol=1e-2)
        assert live.requests == 2  # both chunks (one per URL) went to the live server
        assert silent.requests() == ["GET /health"]
    finally:
        silent.close()
        live.close()


def test_main_serve_bad_arguments(capsys):
    assert main_serve(["no-such-reward", "--port", "0"]) == 2
    assert "unknown reward" in capsys.readouterr().err
    assert main_serve(["shapes", "-o", "bad"]) == 2


def test_main_serve_cli_process(tmp_path):
    """`main_serve` in a child process: prints its URL, answers /health and /score, exits 0 on Ctrl-C."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "FLOWCREDIT_REWARD_TOKEN": "t0k"}
    code = "import sys; from flowcredit.rewards.server import main_serve; sys.exit(main_serve(sys.argv[1:]))"
    # A suite started in the background (`pytest &` in a non-interactive shell) inherits SIGINT ignored, and Python
    # then installs no KeyboardInterrupt handler in the child: give the child the default disposition back.
    p = subprocess.Popen([sys.executable, "-c", code, "imagestats", "--port", "0", "-o", "stat=brightness"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = p.stdout.readline()
        assert "serving reward 'imagestats' at http://127.0.0.1:" in line and "bearer token" in line, (line, p.stderr.read() if p.poll() is not None else "")
        url = line.split(" at ")[1].split()[0]
        r = build_reward("remote", urls=url, token="t0k")
        x = torch.full((2, 3, 8, 8), 0.25)
        assert torch.allclose(r(x, ["a", "b"], [{}, {}]).scores, torch.full((2,), 0.25), atol=1e-2)
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=20) == 0


def test_client_halves_chunks_the_server_finds_too_large():
    srv = serve_reward("imagestats", port=0, block=False, max_body_bytes=6000)
    try:
        x = torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))  # noise: ~4 KB of base64 PNG each
        r = build_reward("remote", urls=srv.url)
        out = r(x, ["p"] * 8, [{}] * 8)
        q = (x * 255).round() / 255  # PNG quantization
        torch.testing.assert_close(out.scores, build_reward("imagestats")(q, ["p"] * 8, [{}] * 8).scores)
        assert r.requests_per_url[srv.url] > 8  # refused with 413, then resent in halves
    finally:
        srv.close()


def test_normalized_mix_is_served_unsplit(gt_batch):
    x, prompts, meta = gt_batch
    srv = serve_reward("mix", port=0, block=False, options={"spec": "0.5*shapes + 0.5*imagestats", "normalize": "batch"})
    try:
        r = build_reward("remote", urls=[srv.url, srv.url], chunk_size=2)  # would split, but the server says no
        local = build_reward("mix", spec="0.5*shapes + 0.5*imagestats", normalize="batch")
        torch.testing.assert_close(r(x, prompts, meta).scores, local(x, prompts, meta).scores)
        assert r.health()["batch_dependent"] is True
    finally:
        srv.close()
