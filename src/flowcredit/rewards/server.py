"""Serve any registered reward over HTTP (`flowcredit serve-reward NAME`), so a reward with conflicting dependencies
(e.g. GenEval's mmdet detector) runs in its own environment and the trainer uses it through the `remote` reward.

Standard library only (`http.server.ThreadingHTTPServer`). The wire format is typed JSON (`wire.py`): images as
base64 PNG or a base64 safetensors file, never pickle (flow_grpo's reward servers unpickle request bodies, which
executes code chosen by whoever can reach the port).

Safety defaults: binds to 127.0.0.1 unless `host` says otherwise; optional bearer token (constant-time compare);
bodies above `max_body_bytes`, images above `max_pixels`, batches above `max_batch`, pickle, non-JSON and
schema-violating requests get a 4xx with a one-line reason. A reward that raises ValueError cannot score that input
(e.g. `shapes` on a 20x20 image: "resolution 20 is not supported"): 422 with its message, which the client raises
at once as `RewardInputError`, unretried; any other reward exception is a server fault: 500 with its message, which
the client retries (on the other URLs, then in later rounds). Either way the server keeps serving. Handler sockets
time out after `request_timeout` seconds (slow clients cannot pin threads).

Batching: requests are queued to one scoring thread (the reward is never called concurrently), which merges queued
requests of the same image size into one reward call of at most `max_batch` images (waiting up to `batch_wait_s`
for more), then splits the outputs back. Rewards whose scores depend on the batch (`batch_dependent = True`, e.g. a
normalized mix) are scored request by request, unsplit.

Endpoints: GET /health (open: {"status", "reward", "schema", "batch_dependent", "max_batch", "max_body_bytes",
"queued", "served"}),
GET /schema (the wire docs), POST /score (token required when set).
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from .base import RewardOutput, check_output
from .wire import SCHEMA, WireError, decode_request, encode_response

LOOPBACK = "127.0.0.1"
TOKEN_ENV = "FLOWCREDIT_REWARD_TOKEN"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _one_line(s: object) -> str:
    return " ".join(str(s).split())


def _split(out: RewardOutput, sizes: Sequence[int]) -> list[RewardOutput]:
    res, start = [], 0
    total = sum(sizes)
    for n in sizes:
        sl = slice(start, start + n)
        info = {k: (v[sl] if isinstance(v, list) and len(v) == total else v) for k, v in out.info.items()}
        res.append(RewardOutput(out.scores[sl], {k: v[sl] for k, v in out.components.items()}, info))
        start += n
    return res


class _Job:
    __slots__ = ("images", "prompts", "metadata", "future")

    def __init__(self, images, prompts, metadata):
        self.images, self.prompts, self.metadata, self.future = images, prompts, metadata, Future()


class _Handler(BaseHTTPRequestHandler):
    """HTTP handler of a RewardServer: GET /health, GET /schema, POST /score. `RewardServer._handler_class` makes the
    subclass that sets `reward_server` (the server it answers for) and `timeout` (the socket timeout, seconds)."""

    reward_server: RewardServer
    server_version = "flowcredit-reward/1"

    def log_message(self, fmt, *args):  # quiet by default; errors are in the responses
        pass

    def _json(self, code: int, obj: Any = None, raw: bytes | None = None, close: bool = False) -> None:
        data = raw if raw is not None else json.dumps(obj).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if code == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _error(self, code: int, reason: str, close: bool = False) -> None:
        self._json(code, {"error": reason, "status": code}, close=close)

    def do_GET(self):
        server = self.reward_server
        path = self.path.split("?", 1)[0]
        if path == "/health":
            return self._json(
                200,
                {
                    "status": "ok",
                    "reward": server.name,
                    "schema": SCHEMA,
                    "batch_dependent": server.batch_dependent,
                    "max_batch": server.max_batch,
                    "max_body_bytes": server.max_body_bytes,
                    "queued": server._q.qsize(),
                    "served": server.served,
                },
            )
        if path == "/schema":
            from . import wire

            return self._json(200, {"schema": SCHEMA, "doc": wire.__doc__})
        self._error(404, f"no such endpoint {path}; use GET /health, GET /schema, POST /score")

    def _drain(self, n: int) -> None:
        """Read and drop up to n body bytes, so the client can read our error instead of a reset."""
        try:
            while n > 0:
                chunk = self.rfile.read(min(n, 1 << 16))
                if not chunk:
                    break
                n -= len(chunk)
        except OSError:
            pass

    def _read_body(self, length_h: str | None) -> bytes | None:
        """The request body of `Content-Length: length_h` bytes, or None after answering 411 / 400 / 413 (no or a
        chunked length, a bad length, a body above max_body_bytes, an unreadable or short body)."""
        server = self.reward_server
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked" or length_h is None:
            self._error(411, "Content-Length is required (chunked bodies are not accepted)", close=True)
            return None
        try:
            length = int(length_h)
            if length < 0:
                raise ValueError
        except ValueError:
            self._error(400, f"bad Content-Length {length_h!r}", close=True)
            return None
        if length > server.max_body_bytes:
            if length <= server.max_body_bytes + (8 << 20):
                self._drain(length)
            self._error(413, f"body of {length} bytes exceeds max_body_bytes={server.max_body_bytes}", close=True)
            return None
        try:
            body = self.rfile.read(length)
        except OSError as e:
            self._error(400, f"could not read the body: {e}", close=True)
            return None
        if len(body) != length:
            self._error(400, f"body shorter than Content-Length ({len(body)} < {length})", close=True)
            return None
        return body

    def do_POST(self):
        server = self.reward_server
        path = self.path.split("?", 1)[0]
        length_h = self.headers.get("Content-Length")
        if path == "/score":
            with server._count_lock:
                server.requests += 1
        if path != "/score":
            return self._error(404, f"no such endpoint {path}; POST /score", close=True)
        if server.token is not None:
            got = self.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {server.token}".encode()):
                return self._error(401, "missing or wrong bearer token (Authorization: Bearer <token>)", close=True)
        body = self._read_body(length_h)
        if body is None:
            return None
        try:
            ctype = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                from .wire import looks_like_pickle

                if looks_like_pickle(body):
                    raise WireError(
                        400, "pickle payloads are refused: send JSON (schema flowcredit.reward.v1, see GET /schema)"
                    )
                raise WireError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
            images, prompts, meta = decode_request(body, server.max_pixels, server.max_batch)
        except WireError as e:
            return self._error(e.status, e.reason)
        t0 = time.perf_counter()
        try:
            out = server.score(images, prompts, meta)
        except WireError as e:  # 422: the reward cannot score this input (it raised ValueError)
            return self._error(e.status, e.reason)
        except Exception as e:  # noqa: BLE001  (the reward failed: report it, keep serving)
            return self._error(500, f"reward '{server.name}' failed: {type(e).__name__}: {_one_line(e)}")
        with server._count_lock:
            server.served += len(prompts)
        self._json(200, raw=encode_response(server.name, out, time.perf_counter() - t0))

    def do_PUT(self):
        self._error(405, "method not allowed; POST /score", close=True)

    do_DELETE = do_PATCH = do_PUT


class RewardServer:
    """An HTTP server around one reward object. `start()` serves on a background thread; `serve_forever()` blocks.

    A reward that raises ValueError is answered 422 (this input cannot be scored), any other exception 500 (a
    server fault); `requests` counts the POST /score requests received, whatever their answer.

    Args:
        reward: a reward callable (or use `serve_reward(name, ...)` to build one from the registry).
        host, port: bind address (port 0 = any free port; see `.url`).
        token: bearer token required on POST /score (None = no auth).
        max_body_bytes, max_pixels, max_batch: request limits (413 above them).
        batch_wait_s: how long the scoring thread waits to merge queued requests.
        request_timeout: socket timeout of a connection, in seconds.
    """

    def __init__(self, reward: Any, host: str = LOOPBACK, port: int = 0, token: str | None = None,
                 max_body_bytes: int = 64 << 20, max_pixels: int = 4096 * 4096, max_batch: int = 256,
                 batch_wait_s: float = 0.005, request_timeout: float = 60.0, name: str | None = None):
        self.reward = reward
        self.name: str = name or str(getattr(reward, "name", type(reward).__name__))
        self.token = token or None
        self.max_body_bytes, self.max_pixels, self.max_batch = int(max_body_bytes), int(max_pixels), int(max_batch)
        self.batch_wait_s = float(batch_wait_s)
        self.batch_dependent = bool(getattr(reward, "batch_dependent", False))
        self.served = 0
        self.requests = 0
        self._count_lock = threading.Lock()
        self._q: queue.Queue[_Job | None] = queue.Queue()
        self._closing = threading.Event()
        self._httpd = ThreadingHTTPServer((host, port), self._handler_class(float(request_timeout)))
        self._httpd.daemon_threads = True
        self._threads: list[threading.Thread] = []
        self._worker = threading.Thread(target=self._work, name=f"reward-server-{self.name}", daemon=True)
        self._worker.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        h, p = self.address
        return f"http://{h}:{p}"

    # ------------------------------------------------------------------------------------------- scoring
    def _work(self) -> None:
        pending: list[_Job] = []
        while True:
            job = pending.pop(0) if pending else self._q.get()
            if job is None:
                return
            batch = [job]
            if not self.batch_dependent:
                deadline = time.monotonic() + self.batch_wait_s
                n = job.images.shape[0]
                while n < self.max_batch:
                    try:
                        nxt = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
                    except queue.Empty:
                        break
                    if nxt is None:
                        self._q.put(None)
                        break
                    if nxt.images.shape[1:] == job.images.shape[1:] and n + nxt.images.shape[0] <= self.max_batch:
                        batch.append(nxt)
                        n += nxt.images.shape[0]
                    else:
                        pending.append(nxt)
            self._score(batch)

    def _call_reward(self, images, prompts, metadata) -> RewardOutput:
        """The reward on one batch, its output checked. ValueError from the reward (it cannot score this input)
        becomes WireError(422) with its message; a bad output (RewardError) or any other exception is left as is
        (500)."""
        try:
            out = self.reward(images, prompts, metadata)
        except WireError:
            raise
        except ValueError as e:
            raise WireError(422, f"reward '{self.name}' cannot score this input: {_one_line(e)}") from e
        return check_output(self.name, out, images.shape[0])

    def _score(self, batch: list[_Job]) -> None:
        if len(batch) > 1:
            try:
                imgs = torch.cat([j.images for j in batch])
                out = self._call_reward(imgs, [p for j in batch for p in j.prompts],
                                        [m for j in batch for m in j.metadata])
                for j, o in zip(batch, _split(out, [j.images.shape[0] for j in batch])):
                    j.future.set_result(o)
                return
            except Exception:  # noqa: BLE001  (score one by one below, so one bad request fails alone)
                pass
        for j in batch:
            try:
                j.future.set_result(self._call_reward(j.images, j.prompts, j.metadata))
            except Exception as e:  # noqa: BLE001  (not swallowed: the request's future raises it)
                j.future.set_exception(e)

    def score(self, images, prompts, metadata) -> RewardOutput:
        """Queue one request for the scoring thread and wait for its output."""
        if self._closing.is_set():
            raise WireError(503, "server is shutting down")
        job = _Job(images, prompts, metadata)
        self._q.put(job)
        return job.future.result()

    # ------------------------------------------------------------------------------------------- HTTP
    def _handler_class(self, request_timeout: float) -> type[_Handler]:
        """The request handler class of this server: `_Handler` bound to this RewardServer, with sockets that time
        out after `request_timeout` seconds."""

        class Handler(_Handler):
            timeout = request_timeout
            reward_server = self

        return Handler

    def start(self) -> RewardServer:
        t = threading.Thread(target=self._httpd.serve_forever, name=f"reward-http-{self.name}", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        self._closing.set()
        self._httpd.shutdown() if self._threads else None
        self._httpd.server_close()
        self._q.put(None)
        self._worker.join(timeout=5)

    def __enter__(self) -> RewardServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_reward(
    name: str,
    host: str = LOOPBACK,
    port: int = 8765,
    token: str | None = None,
    max_body_bytes: int = 64 << 20,
    options: dict[str, Any] | None = None,
    block: bool = True,
    **server_kwargs: Any,
) -> RewardServer:
    """Build reward `name` from the registry with `options` and serve it.

    block=True serves until interrupted (then closes and returns the server); block=False starts it on a
    background thread and returns it (`.url`, `.close()`).
    """
    from .registry import build_reward

    reward = build_reward(name, **(options or {}))
    srv = RewardServer(
        reward, host=host, port=port, token=token, max_body_bytes=max_body_bytes, name=name, **server_kwargs
    )
    if not block:
        return srv.start()
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
    return srv


def _parse_option(s: str) -> tuple[str, Any]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"option must be key=value, got {s!r}")
    k, v = s.split("=", 1)
    import yaml

    try:
        val = yaml.safe_load(v) if v else None
    except yaml.YAMLError:
        val = v
    return k.strip(), val


def main_serve(argv: Sequence[str] | None = None) -> int:
    """`flowcredit serve-reward NAME [--host H] [--port P] [--token T | --token-file F] [-o key=value ...]`.

    Returns the exit code: 0 after Ctrl-C, 2 on bad arguments or a reward that cannot be built.
    """
    ap = argparse.ArgumentParser(
        prog="flowcredit serve-reward", description="Serve a registered reward over HTTP (JSON; never pickle)."
    )
    ap.add_argument("name", help="registered reward name (flowcredit.rewards.registry) or module:Class")
    ap.add_argument(
        "--host",
        default=LOOPBACK,
        help="bind address (default 127.0.0.1; a non-loopback host exposes the reward to the network)",
    )
    ap.add_argument("--port", type=int, default=8765, help="port (0 = any free port; the URL is printed)")
    ap.add_argument(
        "--token", default=None, help=f"bearer token required on POST /score (default: ${TOKEN_ENV} if set)"
    )
    ap.add_argument("--token-file", default=None, help="read the token from this file (first line)")
    ap.add_argument("--max-body-mb", type=float, default=64.0, help="largest accepted request body, MiB (413 above)")
    ap.add_argument("--max-batch", type=int, default=256, help="most images per request and per merged reward call")
    ap.add_argument("--max-pixels", type=int, default=4096 * 4096, help="largest accepted image, in pixels")
    ap.add_argument("--batch-wait-ms", type=float, default=5.0, help="how long to wait to merge queued requests")
    ap.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        type=_parse_option,
        metavar="KEY=VALUE",
        help="reward option (YAML value), e.g. -o model=/models/PickScore_v1 -o batch_size=16",
    )
    try:
        args = ap.parse_args(list(argv) if argv is not None else None)
    except SystemExit as e:
        return int(e.code or 0) if e.code in (0, None) else 2
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if args.token_file:
        try:
            token = open(args.token_file).readline().strip() or None
        except OSError as e:
            print(f"error: --token-file: {e}", file=sys.stderr)
            return 2
    if not is_loopback(args.host) and token is None:
        print(
            f"warning: serving '{args.name}' on {args.host} without a token: anyone who can reach the port can use it",
            file=sys.stderr,
        )
    try:
        srv = serve_reward(
            args.name,
            host=args.host,
            port=args.port,
            token=token,
            max_body_bytes=int(args.max_body_mb * (1 << 20)),
            options=dict(args.option),
            block=False,
            max_batch=args.max_batch,
            max_pixels=args.max_pixels,
            batch_wait_s=args.batch_wait_ms / 1000,
        )
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"serving reward '{args.name}' at {srv.url} (POST /score, GET "
        f"/health){' with a bearer token' if token else ''}",
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
    return 0
