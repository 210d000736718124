"""VLM judge over any OpenAI-compatible chat endpoint (SGLang, vLLM, ...): UnifiedReward-style scoring.

Each image is sent as a base64 PNG data URL in a chat message together with the prompt filled into a template; the
score is the number after "Final Score:" in the reply, divided by `scale` (flow_grpo `unifiedreward_score_sglang`:
the 1–5 score / 5, images resized to 512 px, temperature 0).

Robustness (the field's reward servers fail silently, shared/docs/LANDSCAPE.md §3):
- at most `max_concurrency` requests in flight per reward;
- each request has a `timeout`; transport errors, HTTP 408/429/5xx, replies that are not chat-completion JSON and
  replies without a valid "Final Score:" are retried up to `max_retries` times with exponential backoff
  (`backoff`·2^k, capped at `backoff_max`, ±`jitter`), all within a total `budget_s` per batch;
- other HTTP 4xx (a bad request, a wrong model name, a wrong key) fail at once;
- when an image still has no score, the batch raises `VLMJudgeError` naming the image, attempts and last error
  (`on_failure="raise"`, default) or scores it `failure_score` and flags it in the `vlm_failed` component
  (`on_failure="score"`), never silently;
- replies are cached by (sha256 of the PNG, prompt) in an LRU of `cache_size` entries.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .base import Reward, RewardError, RewardOutput, check_inputs, to_uint8_hwc

# The UnifiedReward prompt of the Stepwise paper's appendix E.3, with the caption line of flow_grpo's
# `unifiedreward_score_sglang` (UnifiedReward's own inference format).
UNIFIEDREWARD_TEMPLATE = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the provided "
    "caption. Consider the accuracy of depicted objects, their relationships, and attributes.\n2. Overall Image "
    "Quality: Examine the visual quality including clarity, detail preservation, color accuracy, and aesthetic "
    "appeal.\nAssign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: "
    "[{prompt}]"
)

_SCORE = re.compile(r"final\s*score\s*[:：]\s*\**\s*([-+]?\d+(?:\.\d+)?)", re.IGNORECASE)


class VLMJudgeError(RewardError):
    """The judge could not score an image within its retries / budget, or the endpoint refused the request."""


class _Retryable(Exception):
    pass


def parse_final_score(text: str, lo: float = 1.0, hi: float = 5.0) -> float | None:
    """The number after the last "Final Score:" in `text`, if it lies in [lo, hi]; else None."""
    found = _SCORE.findall(text or "")
    if not found:
        return None
    v = float(found[-1])
    return v if lo <= v <= hi else None


def png_bytes(img_hwc: np.ndarray, size: int | None = None) -> bytes:
    from PIL import Image

    im = Image.fromarray(img_hwc)
    if size is not None and im.size != (size, size):
        im = im.resize((size, size), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def chat_completions_url(url: str) -> str:
    """Accept a server root, a `/v1` base URL or the full `/v1/chat/completions` URL."""
    u = url.rstrip("/")
    if u.endswith("/chat/completions"):
        return u
    if u.endswith("/v1"):
        return u + "/chat/completions"
    return u + "/v1/chat/completions"


class VLMJudgeReward(Reward):
    """Scores images with a VLM judge behind an OpenAI-compatible `/v1/chat/completions` endpoint.

    Args:
        url: server root, `/v1` base, or full chat-completions URL.
        model: served model name (UnifiedReward: "UnifiedReward-7b-v1.5").
        api_key: sent as `Authorization: Bearer`; None sends none.
        template: user text; "{prompt}" is replaced by the caption (default: UnifiedReward's).
        image_size: images are resized to image_size² before PNG encoding (flow_grpo: 512); None keeps the size.
        scale: score = Final Score / scale (flow_grpo: 5 → 0.2–1).
        score_range: valid raw scores; a number outside counts as an unparsable reply.
        max_concurrency, timeout, max_retries, backoff, backoff_max, jitter, budget_s: see the module docstring.
        temperature, max_tokens: sampling options sent with the request.
        cache_size: LRU entries (0 disables the cache).
        on_failure: "raise" or "score" (use `failure_score` and flag `vlm_failed`).
    Components: `raw` (the parsed 1–5 score), `vlm_failed` (0/1). Info: `replies`, `attempts`, `cache_hits`.
    """

    name = "vlm"

    def __init__(
        self,
        url: str = "http://127.0.0.1:17140/v1",
        model: str = "UnifiedReward-7b-v1.5",
        api_key: str | None = None,
        template: str = UNIFIEDREWARD_TEMPLATE,
        image_size: int | None = 512,
        scale: float = 5.0,
        score_range: Sequence[float] = (1.0, 5.0),
        max_concurrency: int = 8,
        timeout: float = 60.0,
        max_retries: int = 3,
        backoff: float = 1.0,
        backoff_max: float = 30.0,
        jitter: float = 0.1,
        budget_s: float = 600.0,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        cache_size: int = 4096,
        on_failure: str = "raise",
        failure_score: float = 0.0,
        seed: int = 0,
    ):
        if on_failure not in ("raise", "score"):
            raise ValueError(f"reward 'vlm': on_failure must be 'raise' or 'score', got {on_failure!r}")
        if "{prompt}" not in template:
            raise ValueError("reward 'vlm': template must contain '{prompt}'")
        if max_concurrency < 1 or max_retries < 0 or timeout <= 0 or budget_s <= 0:
            raise ValueError("reward 'vlm': need max_concurrency >= 1, max_retries >= 0, timeout > 0, budget_s > 0")
        self.url = chat_completions_url(url)
        self.model, self.api_key, self.template = model, api_key, template
        self.image_size, self.scale = image_size, float(scale)
        self.lo, self.hi = float(score_range[0]), float(score_range[1])
        self.max_concurrency, self.timeout, self.max_retries = int(max_concurrency), float(timeout), int(max_retries)
        self.backoff, self.backoff_max, self.jitter, self.budget_s = (
            float(backoff),
            float(backoff_max),
            float(jitter),
            float(budget_s),
        )
        self.temperature, self.max_tokens = temperature, max_tokens
        self.on_failure, self.failure_score = on_failure, float(failure_score)
        self.cache_size = int(cache_size)
        self._cache: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._pool = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="vlm")

    # ------------------------------------------------------------------------------------------ one request
    def _payload(self, png: bytes, prompt: str) -> bytes:
        data_url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url}},
                        {"type": "text", "text": self.template.replace("{prompt}", prompt)},
                    ],
                }
            ],
            "temperature": self.temperature,
        }
        if self.max_tokens is not None:
            body["max_tokens"] = int(self.max_tokens)
        return json.dumps(body).encode()

    def _request(self, payload: bytes, timeout: float) -> str:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=payload, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode("utf-8", "replace")
            if e.code in (408, 429) or e.code >= 500:
                raise _Retryable(f"HTTP {e.code}: {detail}") from None
            raise VLMJudgeError(f"VLM endpoint {self.url} refused the request: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException, OSError) as e:
            raise _Retryable(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
        try:
            return json.loads(raw)["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Retryable(f"not a chat-completion reply: {raw[:200]!r}") from None

    def _delay(self, attempt: int) -> float:
        d = min(self.backoff_max, self.backoff * (2**attempt))
        with self._lock:
            return d * (1 + self.jitter * (2 * self._rng.random() - 1))

    def _score_one(
        self, png: bytes, prompt: str, deadline: float, stop: threading.Event
    ) -> tuple[float | None, str, int, str | None]:
        """→ (raw score or None, reply text, attempts, error). Raises VLMJudgeError on a non-retryable refusal."""
        payload = self._payload(png, prompt)
        last, text = "", ""
        for attempt in range(self.max_retries + 1):
            remaining = deadline - time.monotonic()
            if stop.is_set():
                return (
                    None,
                    text,
                    attempt,
                    f"stopped after {attempt} attempts because another image of the batch failed; last error: {last}",
                )
            if remaining <= 0:
                return (
                    None,
                    text,
                    attempt,
                    f"budget of {self.budget_s:g} s exhausted after {attempt} attempts; last error: {last}",
                )
            try:
                text = self._request(payload, min(self.timeout, remaining))
                score = parse_final_score(text, self.lo, self.hi)
                if score is not None:
                    return score, text, attempt + 1, None
                last = f"no valid 'Final Score:' in reply {text[:200]!r}"
            except _Retryable as e:
                last = str(e)
            if attempt < self.max_retries:
                d = self._delay(attempt)
                if time.monotonic() + d >= deadline:
                    return (
                        None,
                        text,
                        attempt + 1,
                        f"budget of {self.budget_s:g} s exhausted after {attempt + 1} attempts; last error: {last}",
                    )
                stop.wait(d)
        return None, text, self.max_retries + 1, f"gave up after {self.max_retries + 1} attempts; last error: {last}"

    # ------------------------------------------------------------------------------------------ batch
    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any
    ) -> RewardOutput:
        b = check_inputs(self.name, images, prompts, None)
        deadline = time.monotonic() + self.budget_s
        pngs = [png_bytes(a, self.image_size) for a in to_uint8_hwc(images).numpy()]
        keys = [(hashlib.sha256(p).hexdigest(), pr) for p, pr in zip(pngs, prompts)]
        raw: list[float | None] = [None] * b
        replies, attempts = [""] * b, [0] * b
        errors: list[str | None] = [None] * b
        hits = 0
        todo = []
        with self._lock:
            for i, k in enumerate(keys):
                if k in self._cache:
                    self._cache.move_to_end(k)
                    raw[i], replies[i] = self._cache[k]
                    hits += 1
                else:
                    todo.append(i)
        stop = threading.Event()
        futs = {i: self._pool.submit(self._score_one, pngs[i], prompts[i], deadline, stop) for i in todo}
        fatal: BaseException | None = None
        for i, f in futs.items():
            try:
                raw[i], replies[i], attempts[i], errors[i] = f.result()
            except VLMJudgeError as e:
                fatal = fatal or e
                stop.set()
            if errors[i] is not None and self.on_failure == "raise":
                stop.set()  # fail fast: the others stop retrying
        if fatal is not None:
            raise fatal
        failed = [i for i in range(b) if raw[i] is None]
        if failed and self.on_failure == "raise":
            i = failed[0]
            raise VLMJudgeError(
                f"VLM judge at {self.url} gave no score for image {i} (prompt {prompts[i]!r}): "
                f"{errors[i] or 'stopped after another image failed'} ({len(failed)}/{b} images failed)"
            )
        with self._lock:
            for i in todo:
                score = raw[i]
                if score is not None and self.cache_size > 0:
                    self._cache[keys[i]] = (score, replies[i])
                    self._cache.move_to_end(keys[i])
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        r = torch.tensor([v if v is not None else float("nan") for v in raw], dtype=torch.float32)
        fail = torch.isnan(r)
        scores = torch.where(fail, torch.full_like(r, self.failure_score), r / self.scale)
        return RewardOutput(
            scores,
            {"raw": torch.nan_to_num(r, nan=0.0), "vlm_failed": fail.float()},
            {"replies": replies, "attempts": attempts, "errors": errors, "cache_hits": hits},
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class UnifiedReward(VLMJudgeReward):
    """`VLMJudgeReward` under the name "unifiedreward" (UnifiedReward-7b-v1.5 defaults)."""

    name = "unifiedreward"
