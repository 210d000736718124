"""The `remote` reward: scores through one or more `flowcredit serve-reward` servers (wire format: `wire.py`).

A batch is split into contiguous chunks, one per server (or of `chunk_size` images), sent concurrently, starting
at a round-robin offset that advances every call; a chunk whose server fails (connection error, timeout, 5xx) is
retried on the next server, with exponential backoff between rounds, up to `max_retries` rounds. 4xx answers are the
client's fault and raise at once with the server's reason, except 413 (too large), after which the chunk is halved
and resent. If every server fails, `RemoteRewardError` names each
URL and its last error. Servers that report `batch_dependent` (e.g. a normalized mix) get the whole batch, unsplit.
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
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from torch import Tensor

from .base import Reward, RewardError, RewardOutput, check_inputs, concat_outputs
from .wire import ENCODINGS, WireError, decode_response, encode_request

TOKEN_ENV = "FLOWCREDIT_REWARD_TOKEN"


class RemoteRewardError(RewardError):
    """The reward service refused the request (4xx; `status`) or no server could score it."""

    def __init__(self, msg: str, status: int | None = None):
        super().__init__(msg)
        self.status = status


class _ServerDown(Exception):
    pass


class RemoteReward(Reward):
    """Client of `flowcredit serve-reward` servers.

    Args:
        urls: one URL, a comma-separated string or a list (e.g. ["http://127.0.0.1:8765", "http://127.0.0.1:8766"]).
        token: bearer token (default: $FLOWCREDIT_REWARD_TOKEN).
        timeout: seconds per HTTP request.
        encoding: "png" (8-bit, compact) or "safetensors" (float32, bit-exact).
        chunk_size: most images per request (default: split the batch evenly over the servers).
        max_retries: extra rounds over the servers after a failure; backoff: first delay of the rounds, seconds.
        name: the label used in logs and mixes (default "remote"; e.g. "geneval").
        max_concurrency: requests in flight at once (default: one per URL).
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
        self.token = token or os.environ.get(TOKEN_ENV) or None
        self.timeout, self.encoding, self.chunk_size = float(timeout), encoding, chunk_size
        self.max_retries, self.backoff = int(max_retries), float(backoff)
        if name:
            self.name = name
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, int(max_concurrency or len(self.urls))), thread_name_prefix="remote-reward"
        )
        self._batch_dependent: bool | None = None
        self._server_max_batch: int | None = None
        self._server_max_body: int | None = None
        self.requests_per_url = dict.fromkeys(self.urls, 0)

    # ------------------------------------------------------------------------------------------ HTTP
    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h

    def _call(self, url: str, method: str, path: str, body: bytes | None = None) -> bytes:
        req = urllib.request.Request(url + path, data=body, headers=self._headers(), method=method)
        with self._lock:
            self.requests_per_url[url] += 1
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            try:
                reason = json.loads(e.read()).get("error", "")
            except (ValueError, AttributeError, OSError):
                reason = ""
            if 400 <= e.code < 500:
                raise RemoteRewardError(
                    f"reward service {url} refused the request: HTTP {e.code}: {reason}", e.code
                ) from None
            raise _ServerDown(f"HTTP {e.code}: {reason}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException, OSError) as e:
            raise _ServerDown(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None

    def health(self, url: str | None = None) -> dict[str, Any]:
        """GET /health of one server (default: the first)."""
        return json.loads(self._call(url or self.urls[0], "GET", "/health"))

    def _is_batch_dependent(self) -> bool:
        if self._batch_dependent is None:
            for u in self.urls:
                try:
                    h = self.health(u)
                    self._batch_dependent = bool(h.get("batch_dependent", False))
                    self._server_max_batch = int(h["max_batch"]) if h.get("max_batch") else None
                    self._server_max_body = int(h["max_body_bytes"]) if h.get("max_body_bytes") else None
                    break
                except (_ServerDown, RemoteRewardError, ValueError):
                    continue
            else:
                return False  # nobody answers now; the scoring call reports the errors
        return self._batch_dependent

    def _score_chunk(self, images: Tensor, prompts, metadata, start: int, splittable: bool = True) -> RewardOutput:
        """Score one chunk; a chunk the server finds too large (413) is halved and retried (unless batch-dependent)."""
        try:
            return self._score_chunk_once(images, prompts, metadata, start)
        except RemoteRewardError as e:
            b = images.shape[0]
            if e.status != 413 or b < 2 or not splittable:
                raise
            h = b // 2
            return concat_outputs(
                [
                    self._score_chunk(images[:h], prompts[:h], metadata[:h], start),
                    self._score_chunk(images[h:], prompts[h:], metadata[h:], start + 1),
                ]
            )

    def _score_chunk_once(self, images: Tensor, prompts, metadata, start: int) -> RewardOutput:
        body = encode_request(images, prompts, metadata, self.encoding)
        if self._server_max_body and len(body) > self._server_max_body:  # would be refused: split before sending
            raise RemoteRewardError(
                f"a request of {images.shape[0]} images is {len(body)} bytes, more than the server's "
                f"max_body_bytes={self._server_max_body}",
                413,
            )
        errors: dict[str, str] = {}
        n = len(self.urls)
        for rnd in range(self.max_retries + 1):
            for k in range(n):
                url = self.urls[(start + k) % n]
                try:
                    out = decode_response(self._call(url, "POST", "/score", body), images.shape[0])
                except _ServerDown as e:
                    errors[url] = str(e)
                    continue
                except WireError as e:
                    errors[url] = e.reason
                    continue
                return out
            if rnd < self.max_retries:
                time.sleep(self.backoff * (2**rnd))
        detail = "; ".join(f"{u}: {m}" for u, m in errors.items())
        raise RemoteRewardError(
            f"no reward server could score {images.shape[0]} images after {self.max_retries + 1} rounds: {detail}"
        )

    # ------------------------------------------------------------------------------------------ reward
    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any
    ) -> RewardOutput:
        b = check_inputs(self.name, images, prompts, metadata)
        metadata = list(metadata) if metadata is not None else [{} for _ in range(b)]
        start = next(self._rr) % len(self.urls)
        dependent = self._is_batch_dependent()
        if dependent:
            size = b
        elif self.chunk_size:
            size = int(self.chunk_size)
        else:
            size = -(-b // len(self.urls))
        if not dependent and self._server_max_batch:
            size = min(size, self._server_max_batch)
        bounds = [(i, min(i + size, b)) for i in range(0, b, size)]
        futs = [
            self._pool.submit(
                self._score_chunk, images[i:j], list(prompts[i:j]), metadata[i:j], start + c, not dependent
            )
            for c, (i, j) in enumerate(bounds)
        ]
        out = concat_outputs([f.result() for f in futs])
        res = out.info.get("results")
        if isinstance(res, list) and res and all(isinstance(r, dict) for r in res):
            out.info["results"] = [SimpleNamespace(**r) for r in res]  # attribute access, like local results
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
