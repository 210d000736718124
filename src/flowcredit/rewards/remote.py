"""The `remote` reward: scores through one or more `flowcredit serve-reward` servers (wire format: `wire.py`).

A batch is split into contiguous chunks, one per server (or of `chunk_size` images), sent concurrently, starting
at a round-robin offset that advances every call. Servers that report `batch_dependent` (e.g. a normalized mix) get
the whole batch, unsplit.

What fails how:

* Server faults (connection refused, timeout, 5xx, 408/429, a reply that is not a valid score list): the chunk is
  retried on the next server, with exponential backoff between rounds, up to `max_retries` extra rounds; if every
  try fails, `RemoteRewardError` (a `RewardError`, not a `ValueError`) names each URL and its last error.
* Input errors (any other 4xx: the server's reward raised ValueError for this input → 422, a request the server
  refuses → 400/401/404/415/...): `RewardInputError` (a `ValueError`) at once, naming the URL and the server's
  reason on one line; no retry, no other URL (they run the same reward and would refuse it the same way). 413 (too
  large) is the exception: the chunk is halved and resent; a single image that is still too large is an input error.

The deadline: `timeout` seconds bound one call of the reward, from its start to its result or error: the `/health`
probes, every try on every URL in every round, and the backoff sleeps all count against it, and each HTTP request
gets what is left of it (at most `timeout`; a socket timeout, so it bounds each wait for bytes: a server that
trickles its reply can stretch one request). When there are more chunks than `max_concurrency` (requests in flight),
the call gets `timeout` per wave of concurrent requests: ceil(chunks / max_concurrency) × `timeout` in all. So a
silent server (accepts, never answers) fails a call within `timeout`, not `timeout` × rounds × URLs + the probe.
A URL that timed out (a probe or a request) is remembered for `silent_s` seconds (default 10 × `timeout`): it is not
health-probed again and it is tried after the other URLs, so the next call (the trainer's retry, `faults`) goes to
the servers that answer; any answer from it clears the mark.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from torch import Tensor

from .base import Reward, RewardError, RewardOutput, check_inputs, concat_outputs
from .wire import ENCODINGS, WireError, decode_response, encode_request

TOKEN_ENV = "FLOWCREDIT_REWARD_TOKEN"
RETRYABLE_4XX = (408, 429)  # request timeout, too many requests: the server's state, not the input (as faults.py)


def _one_line(s: str) -> str:
    return " ".join(str(s).split())


class RemoteRewardError(RewardError):
    """The reward service refused the request (4xx; `status`) or no server could score it."""

    def __init__(self, msg: str, status: int | None = None):
        super().__init__(msg)
        self.status = status


class RewardInputError(RemoteRewardError, ValueError):
    """The reward service answered 4xx: it cannot score this input (422: its reward raised ValueError) or refuses
    the request (400, 401, 413, 415, ...). Not a server fault: retrying, here or on another URL, fails the same way.
    `url`, `status` and `reason` (the server's one-line reason) are attributes; the message holds all three."""

    def __init__(self, url: str, status: int, reason: str):
        self.url, self.reason = url, _one_line(reason)
        super().__init__(f"reward service {url} refused the request: HTTP {status}: {self.reason}", status)

    def __reduce__(self):
        return type(self), (self.url, self.status, self.reason)


class _ServerDown(Exception):
    def __init__(self, msg: str, timed_out: bool = False):
        super().__init__(msg)
        self.timed_out = timed_out


def _is_timeout(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)


class RemoteReward(Reward):
    """Client of `flowcredit serve-reward` servers.

    Args:
        urls: one URL, a comma-separated string or a list (e.g. ["http://127.0.0.1:8765", "http://127.0.0.1:8766"]).
        token: bearer token (default: $FLOWCREDIT_REWARD_TOKEN).
        timeout: the deadline of one call, in seconds: health probes, every try over the URLs and rounds, and the
            backoff included (× the number of waves when there are more chunks than `max_concurrency`; see the
            module docstring). Each HTTP request gets what is left, at most `timeout`.
        encoding: "png" (8-bit, compact) or "safetensors" (float32, bit-exact).
        chunk_size: most images per request (default: split the batch evenly over the servers).
        max_retries: extra rounds over the servers after a server fault (never after an input error, 4xx);
            backoff: first delay of the rounds, seconds. Both stay inside `timeout`.
        name: the label used in logs and mixes (default "remote"; e.g. "geneval").
        max_concurrency: requests in flight at once (default: one per URL).

    Attributes: `requests_per_url` (HTTP requests sent, /health included), `silent_s` (how long a URL that timed
    out is tried last and not probed; 10 × `timeout`).
    """

    name = "remote"

    def __init__(
        self,
        urls: str | Sequence[str] = "http://127.0.0.1:8765",
        token: str | None = None,
        timeout: float = 120.0,
        encoding: str = "png",
        chunk_size: int | None = None,
        max_retries: int = 2,
        backoff: float = 0.5,
        name: str | None = None,
        max_concurrency: int | None = None,
    ):
        if isinstance(urls, str):
            urls = [u for u in urls.split(",") if u.strip()]
        self.urls = [u.strip().rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("reward 'remote' needs urls=[...] of flowcredit serve-reward servers")
        if encoding not in ENCODINGS:
            raise ValueError(f"reward 'remote': encoding must be one of {ENCODINGS}, got {encoding!r}")
        if not float(timeout) > 0:
            raise ValueError(f"reward 'remote': timeout must be > 0 seconds (the deadline of one call), got {timeout}")
        self.token = token or os.environ.get(TOKEN_ENV) or None
        self.timeout, self.encoding, self.chunk_size = float(timeout), encoding, chunk_size
        self.max_retries, self.backoff = int(max_retries), float(backoff)
        self.silent_s = 10 * self.timeout
        if name:
            self.name = name
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._workers = max(1, int(max_concurrency or len(self.urls)))
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="remote-reward")
        self._batch_dependent: bool | None = None
        self._server_max_batch: int | None = None
        self._server_max_body: int | None = None
        self._silent: dict[str, tuple[float, str]] = {}  # url → (monotonic time, what timed out)
        self.requests_per_url = dict.fromkeys(self.urls, 0)

    # ------------------------------------------------------------------------------------------ HTTP
    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h

    def _call(
        self, url: str, method: str, path: str, body: bytes | None = None, timeout: float | None = None
    ) -> bytes:
        """One HTTP request. Raises RewardInputError (4xx but 408/429), or _ServerDown (any server fault)."""
        req = urllib.request.Request(url + path, data=body, headers=self._headers(), method=method)
        with self._lock:
            self.requests_per_url[url] += 1
        t = self.timeout if timeout is None else max(1e-3, min(self.timeout, timeout))
        try:
            with urllib.request.urlopen(req, timeout=t) as resp:
                data = resp.read()
        except urllib.error.HTTPError as e:
            try:
                reason = json.loads(e.read()).get("error", "")
            except (ValueError, AttributeError, OSError):
                reason = ""
            self._answered(url)
            if 400 <= e.code < 500 and e.code not in RETRYABLE_4XX:
                raise RewardInputError(url, e.code, reason or str(e.reason)) from None
            raise _ServerDown(f"HTTP {e.code}: {_one_line(reason)}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException, OSError) as e:
            timed_out = _is_timeout(e)
            if timed_out:
                with self._lock:
                    self._silent[url] = (time.monotonic(), f"{method} {path}")
            raise _ServerDown(f"{type(e).__name__}: {getattr(e, 'reason', e)}", timed_out) from None
        self._answered(url)
        return data

    def _answered(self, url: str) -> None:
        with self._lock:
            self._silent.pop(url, None)

    def _is_silent(self, url: str) -> bool:
        with self._lock:
            got = self._silent.get(url)
        return got is not None and time.monotonic() - got[0] < self.silent_s

    def health(self, url: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        """GET /health of one server (default: the first), waiting at most `timeout` (default: the reward's)."""
        return json.loads(self._call(url or self.urls[0], "GET", "/health", timeout=timeout))

    def _is_batch_dependent(self, deadline: float | None = None) -> bool:
        """Ask the servers (once: the first that answers /health is cached) whether to send batches unsplit.

        The probes count against `deadline`; a URL that timed out recently (`silent_s`) is not probed again. When
        no server answers, the answer is False for this call and the scoring requests report the errors.
        """
        if self._batch_dependent is None:
            for u in self.urls:
                left = self.timeout if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    break
                if self._is_silent(u):
                    continue
                try:
                    h = self.health(u, timeout=left)
                    self._batch_dependent = bool(h.get("batch_dependent", False))
                    self._server_max_batch = int(h["max_batch"]) if h.get("max_batch") else None
                    self._server_max_body = int(h["max_body_bytes"]) if h.get("max_body_bytes") else None
                    break
                except (_ServerDown, RemoteRewardError, ValueError, TypeError, AttributeError):
                    continue  # AttributeError/TypeError: a JSON reply that is not a health object
            else:
                return False  # nobody answers now; the scoring call reports the errors
        return bool(self._batch_dependent)

    def _order(self, start: int) -> list[str]:
        """The URLs a chunk tries, round-robin from `start`; URLs that timed out recently come last."""
        n = len(self.urls)
        rot = [self.urls[(start + k) % n] for k in range(n)]
        return sorted(rot, key=self._is_silent)  # stable: the rotation is kept within each group

    def _score_chunk(
        self, images: Tensor, prompts, metadata, start: int, splittable: bool = True, deadline: float | None = None
    ) -> RewardOutput:
        """Score one chunk; a chunk the server finds too large (413) is halved and retried (unless batch-dependent)."""
        try:
            return self._score_chunk_once(images, prompts, metadata, start, deadline)
        except RemoteRewardError as e:
            b = images.shape[0]
            if e.status != 413 or b < 2 or not splittable:
                raise
            h = b // 2
            return concat_outputs(
                [
                    self._score_chunk(images[:h], prompts[:h], metadata[:h], start, True, deadline),
                    self._score_chunk(images[h:], prompts[h:], metadata[h:], start + 1, True, deadline),
                ]
            )

    def _score_chunk_once(
        self, images: Tensor, prompts, metadata, start: int, deadline: float | None = None
    ) -> RewardOutput:
        t0 = time.monotonic()
        if deadline is None:
            deadline = t0 + self.timeout
        b = images.shape[0]
        body = encode_request(images, prompts, metadata, self.encoding)
        if self._server_max_body and len(body) > self._server_max_body:  # would be refused: split before sending
            raise RewardInputError(
                self.urls[start % len(self.urls)],
                413,
                f"a request of {b} images is {len(body)} bytes, more than the server's "
                f"max_body_bytes={self._server_max_body} (checked before sending)",
            )
        errors: dict[str, str] = {}
        order = self._order(start)
        rounds, out_of_time = 0, False
        for rnd in range(self.max_retries + 1):
            rounds = rnd + 1
            for url in order:  # each URL once per round
                left = deadline - time.monotonic()
                if left <= 0:
                    out_of_time = True
                    break
                try:
                    data = self._call(url, "POST", "/score", body, timeout=left)
                    return decode_response(data, b)
                except _ServerDown as e:
                    errors[url] = str(e)
                except WireError as e:  # 200 with a reply that is not a valid score list
                    errors[url] = e.reason
            if out_of_time or rnd == self.max_retries:
                break
            delay = self.backoff * (2**rnd)
            if time.monotonic() + delay >= deadline:
                out_of_time = True
                break
            if delay > 0:
                time.sleep(delay)
        detail = "; ".join(f"{u}: {self._why_not(u, errors)}" for u in order)
        if out_of_time:
            raise RemoteRewardError(
                f"no reward server could score {b} images within timeout={self.timeout:g} s (the deadline of one "
                f"call, health probes and retries included): {detail}"
            )
        raise RemoteRewardError(f"no reward server could score {b} images after {rounds} rounds: {detail}")

    def _why_not(self, url: str, errors: dict[str, str]) -> str:
        if url in errors:
            return errors[url]
        with self._lock:
            got = self._silent.get(url)
        if got is not None:
            age = time.monotonic() - got[0]
            return f"not tried, no time left (its {got[1]} timed out{f' {age:.0f} s ago' if age >= 1 else ''})"
        return "not tried, no time left"

    # ------------------------------------------------------------------------------------------ reward
    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any
    ) -> RewardOutput:
        t0 = time.monotonic()
        b = check_inputs(self.name, images, prompts, metadata)
        metadata = list(metadata) if metadata is not None else [{} for _ in range(b)]
        start = next(self._rr) % len(self.urls)
        dependent = self._is_batch_dependent(t0 + self.timeout)
        if dependent:
            size = b
        elif self.chunk_size:
            size = int(self.chunk_size)
        else:
            size = -(-b // len(self.urls))
        if not dependent and self._server_max_batch:
            size = min(size, self._server_max_batch)
        bounds = [(i, min(i + size, b)) for i in range(0, b, size)]
        deadline = t0 + self.timeout * -(-len(bounds) // self._workers)  # `timeout` per wave of concurrent requests
        futs: list[Future] = [
            self._pool.submit(
                self._score_chunk, images[i:j], list(prompts[i:j]), metadata[i:j], start + c, not dependent, deadline
            )
            for c, (i, j) in enumerate(bounds)
        ]
        try:
            out = concat_outputs([f.result() for f in futs])
        except BaseException:
            for f in futs:  # the call has failed: chunks not started yet are dropped
                f.cancel()
            raise
        res = out.info.get("results")
        if isinstance(res, list) and res and all(isinstance(r, dict) for r in res):
            out.info["results"] = [SimpleNamespace(**r) for r in res]  # attribute access, like local results
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
