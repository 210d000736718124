"""The VLM judge client against a fake OpenAI-compatible server on 127.0.0.1: scores, payload, faults (500s, slow
replies, garbage text), retries with backoff, the total budget, 4xx refusals, the cache and the concurrency limit."""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image

from flowcredit.rewards.registry import build_reward
from flowcredit.rewards.vlm import UNIFIEDREWARD_TEMPLATE, VLMJudgeError, parse_final_score


class FakeJudge:
    """A scripted chat-completions server. `script` is consumed one action per request:
    ("ok", text) | ("500",) | ("400",) | ("slow", seconds) | ("garbage",) | ("notjson",). When empty, it answers
    "Final Score: n" with n = 1 + len(caption) % 5."""

    def __init__(self):
        self.script: list[tuple] = []
        self.requests: list[dict] = []
        self.times: list[float] = []
        self.inflight = self.max_inflight = 0
        self.delay = 0.0
        self.lock = threading.Lock()
        judge = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.requests.append({"body": body, "auth": self.headers.get("Authorization"), "path": self.path})
                    judge.times.append(time.monotonic())
                    action = judge.script.pop(0) if judge.script else ("default",)
                    judge.inflight += 1
                    judge.max_inflight = max(judge.max_inflight, judge.inflight)
                    self._counted_out = False
                try:
                    time.sleep(judge.delay)
                    if action[0] == "500":
                        return self._send(500, b"internal error")
                    if action[0] == "400":
                        return self._send(400, b'{"error": "unknown model"}')
                    if action[0] == "slow":
                        time.sleep(action[1])
                        text = "Final Score: 5"
                    elif action[0] == "garbage":
                        text = "I think this image is nice."
                    elif action[0] == "notjson":
                        return self._send(200, b"<html>proxy error</html>")
                    elif action[0] == "ok":
                        text = action[1]
                    else:
                        caption = re.search(r"Text Caption: \[(.*)\]", body["messages"][0]["content"][1]["text"]).group(1)
                        text = f"The image is fine.\nFinal Score: {1 + len(caption) % 5}"
                    self._send(200, json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode())
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    self._done()

            def _done(self):
                # leave the in-flight count BEFORE the answer goes out: the client may send its next request as soon
                # as it has read this one, before this thread runs again (3 "in flight" under load otherwise)
                if not getattr(self, "_counted_out", False):
                    self._counted_out = True
                    with judge.lock:
                        judge.inflight -= 1

            def _send(self, code, data):
                self._done()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def judge():
    j = FakeJudge()
    yield j
    j.close()


def _imgs(n=3):
    return torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def _vlm(judge, **kw):
    base = dict(url=judge.url + "/v1", api_key="k", image_size=32, timeout=2.0, max_retries=3, backoff=0.02,
                backoff_max=0.1, budget_s=10.0, max_concurrency=4)
    return build_reward("vlm", **{**base, **kw})


def test_parse_final_score():
    assert parse_final_score("blah\nFinal Score: 4") == 4.0
    assert parse_final_score("**Final Score:** 3.5") == 3.5
    assert parse_final_score("Final Score: 2 ... Final Score: 5") == 5.0  # the last one counts
    assert parse_final_score("final score: 9") is None  # outside 1..5
    assert parse_final_score("no score here") is None


def test_scores_payload_and_order(judge):
    prompts = ["a cat", "two dogs!", "x"]
    r = _vlm(judge)
    out = r(_imgs(), prompts, [{}] * 3)
    expected = torch.tensor([1 + len(p) % 5 for p in prompts], dtype=torch.float32)
    torch.testing.assert_close(out.components["raw"], expected)
    torch.testing.assert_close(out.scores, expected / 5)  # flow_grpo's /5
    assert out.components["vlm_failed"].sum() == 0 and out.info["attempts"] == [1, 1, 1]
    req = judge.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer k"
    body = req["body"]
    assert body["model"] == "UnifiedReward-7b-v1.5" and body["temperature"] == 0
    img_part, text_part = body["messages"][0]["content"]
    assert img_part["image_url"]["url"].startswith("data:image/png;base64,")
    png = base64.b64decode(img_part["image_url"]["url"].split(",", 1)[1])
    assert Image.open(io.BytesIO(png)).size == (32, 32)  # resized to image_size
    assert "Final Score:" in UNIFIEDREWARD_TEMPLATE and text_part["text"].startswith("You are given a text caption")


def test_survives_500_garbage_slow_and_notjson(judge):
    judge.script = [("500",), ("garbage",), ("slow", 1.0), ("notjson",), ("ok", "Final Score: 4")]
    r = _vlm(judge, timeout=0.3, max_retries=5, max_concurrency=1)
    t0 = time.monotonic()
    out = r(_imgs(1), ["a cat"], [{}])
    assert out.scores.tolist() == [pytest.approx(0.8)] and out.info["attempts"] == [5]
    assert len(judge.requests) == 5
    gaps = [b - a for a, b in zip(judge.times, judge.times[1:])]
    assert gaps[0] >= 0.02 * 0.9 and gaps[1] >= 0.04 * 0.9  # exponential backoff between attempts
    assert time.monotonic() - t0 < 5


def test_gives_up_with_clear_error_after_retries_and_budget(judge):
    judge.script = [("500",)] * 100
    r = _vlm(judge, max_retries=2)
    with pytest.raises(VLMJudgeError, match=r"gave no score for image 0 .*gave up after 3 attempts; last error: HTTP 500"):
        r(_imgs(1), ["a cat"], [{}])
    assert len(judge.requests) == 3
    judge.requests.clear()
    r = _vlm(judge, max_retries=1000, backoff=0.05, backoff_max=0.05, budget_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(VLMJudgeError, match=r"budget of 0.5 s exhausted"):
        r(_imgs(1), ["a cat"], [{}])
    assert time.monotonic() - t0 < 1.5 and 3 <= len(judge.requests) < 20  # bounded by the budget
    # on_failure="score": flagged, not silent
    judge.script = [("garbage",)] * 10
    out = _vlm(judge, max_retries=1, on_failure="score")(_imgs(1), ["a cat"], [{}])
    assert out.scores.tolist() == [0.0] and out.components["vlm_failed"].tolist() == [1.0]
    assert "no valid 'Final Score:'" in out.info["errors"][0]


def test_4xx_is_not_retried(judge):
    judge.script = [("400",)] * 10
    with pytest.raises(VLMJudgeError, match="HTTP 400.*unknown model"):
        _vlm(judge)(_imgs(1), ["a cat"], [{}])
    assert len(judge.requests) == 1


def test_cache_and_concurrency_limit(judge):
    judge.delay = 0.4  # long enough that both slots overlap even on a loaded machine (0.1 s flaked under load)
    r = _vlm(judge, max_concurrency=2)
    imgs, prompts = _imgs(6), ["a", "b", "c", "d", "e", "f"]
    a = r(imgs, prompts, [{}] * 6)
    assert judge.max_inflight == 2 and len(judge.requests) == 6
    b = r(imgs, prompts, [{}] * 6)  # all cached: no new request
    assert len(judge.requests) == 6 and b.info["cache_hits"] == 6
    assert torch.equal(a.scores, b.scores)
    r(imgs, ["a", "b", "c", "d", "e", "other"], [{}] * 6)  # the key is (image, prompt)
    assert len(judge.requests) == 7
