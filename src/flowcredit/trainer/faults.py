"""What a run survives, and how it stops when it cannot (config section ``faults``, docs/SCALING.md).

* NaN/Inf in rewards, advantages, loss or gradients → that optimizer update is skipped and counted
  (``nonfinite_skipped`` in metrics.jsonl), with an ALARM line on stderr; after ``faults.max_nonfinite`` consecutive
  skips the run stops with ``RunStopped`` (exit 3 from the CLI). The last checkpoint is never touched.
* A reward call that fails (raises, or runs past ``faults.reward_timeout`` seconds: the bound of ONE attempt) is
  retried ``faults.reward_retries`` times with exponential backoff, then the run stops with ``RunStopped`` (exit 3).
* Except an input error: a reward that raises ``ValueError`` (it cannot score this input, e.g. an unsupported
  resolution), or a reward service that answers 4xx (``RewardInputError``, a ValueError; 408/429 excepted) is not
  retried — the same input fails the same way — and the run stops at once with ``RewardInputRejected`` (a
  ``RunStopped``, so exit 3 from the CLI: the run has started and its last checkpoint is intact; exit 2 is for
  bad input found before anything is written).
* SIGTERM / SIGINT → ``StopSignal.requested``; the trainer finishes the iteration, writes a checkpoint and returns
  (exit 0). A second signal aborts at once.
* ``FLOWCREDIT_FAULT_INJECT=phase:iteration[,phase:iteration...]`` kills the process with SIGKILL when it reaches
  that point (tests of resume; the phases are the trainer's timer phases plus log, eval, checkpoint,
  checkpoint_manifest). ``phase:iteration:rank`` limits it to one rank.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

ENV_INJECT = "FLOWCREDIT_FAULT_INJECT"


class TrainingError(RuntimeError):
    """A run cannot start or continue; the message is one line saying what to fix."""


@contextlib.contextmanager
def one_line(prefix: str = "") -> Iterator[None]:
    """Bad input found while building the run (a ValueError) becomes one TrainingError line, prefixed with the key."""
    try:
        yield
    except ValueError as e:
        raise TrainingError(f"{prefix}{e}") from None


class RunStopped(RuntimeError):
    """The run cannot continue (repeated non-finite updates, a reward that keeps failing); the message is one line
    saying what happened, and the last checkpoint is intact."""


class RewardInputRejected(RunStopped, ValueError):
    """The reward rejected its input (it raised ValueError, or its service answered 4xx): not retried. A RunStopped
    (the CLI prints its one line and exits 3) and a ValueError (what it is about: the input); ``__cause__`` is the
    reward's exception."""


RETRYABLE_4XX = (408, 429)  # request timeout, too many requests: the service's state, not the input


def is_input_error(e: BaseException) -> bool:
    """True when retrying cannot help: ``e`` carries an HTTP ``status`` 4xx (not 408/429), or has no int status and
    is a ValueError (the convention: a reward raises ValueError for an input it cannot score, anything else for a
    fault). A status of 5xx is a server fault even on a ValueError."""
    status = getattr(e, "status", None)
    if isinstance(status, int) and not isinstance(status, bool):
        return 400 <= status < 500 and status not in RETRYABLE_4XX
    return isinstance(e, ValueError)


def inject_point(phase: str, iteration: int, rank: int | None = None) -> None:
    """Kill -9 this process if ``FLOWCREDIT_FAULT_INJECT`` names (phase, iteration[, rank]). A no-op otherwise."""
    spec = os.environ.get(ENV_INJECT)
    if not spec:
        return
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    for item in spec.split(","):
        parts = item.strip().split(":")
        if parts[0] != phase:
            continue
        if len(parts) > 1 and parts[1] and int(parts[1]) != iteration:
            continue
        if len(parts) > 2 and parts[2] and int(parts[2]) != rank:
            continue
        sys.stderr.write(f"[fault-inject] SIGKILL at {phase}:{iteration} (rank {rank})\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def first_nonfinite(**tensors: torch.Tensor | None) -> str | None:
    """The name of the first given tensor holding NaN/Inf, else None."""
    for name, t in tensors.items():
        if t is not None and not bool(torch.isfinite(t).all()):
            return name
    return None


class NonFiniteGuard:
    """Counts updates skipped for NaN/Inf; raises RunStopped after ``max_consecutive`` in a row (0 = never)."""

    def __init__(self, max_consecutive: int, is_main: bool = True):
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total = 0
        self.is_main = is_main

    def skip(self, what: str, iteration: int) -> dict[str, Any]:
        """Record one skipped update; returns the metrics to log."""
        self.consecutive += 1
        self.total += 1
        limit = f" of {self.max_consecutive}" if self.max_consecutive else ""
        if self.is_main:
            print(f"ALARM: non-finite {what} at iteration {iteration}: update skipped ({self.consecutive}{limit} in a "
                  f"row, {self.total} in total)", file=sys.stderr, flush=True)
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise RunStopped(
                f"stopped at iteration {iteration}: {self.consecutive} consecutive updates skipped for NaN/Inf (last: "
                f"{what}); faults.max_nonfinite reached. The last checkpoint is intact; fix the cause (reward, lr, "
                "precision) and resume"
            )
        return {"nonfinite_skipped": self.total, "nonfinite_reason": what}

    def ok(self) -> None:
        self.consecutive = 0

    def state_dict(self) -> dict[str, int]:
        return {"consecutive": self.consecutive, "total": self.total}

    def load_state_dict(self, st: dict[str, int]) -> None:
        self.consecutive, self.total = int(st.get("consecutive", 0)), int(st.get("total", 0))


def _call_with_timeout(fn: Callable, args: tuple, kwargs: dict, timeout: float):
    if not timeout or timeout <= 0:
        return fn(*args, **kwargs)
    # The call runs in a worker thread; past the timeout it is abandoned (Python cannot kill a thread), so a reward
    # that can hang for good should also bound its own I/O (rewards/remote.py does).
    ex = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
    try:
        fut = ex.submit(fn, *args, **kwargs)
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no answer within faults.reward_timeout={timeout:g} s") from None
    finally:
        ex.shutdown(wait=False)


class RetryingCall:
    """Calls a reward with the retry policy of ``faults``; counts retries (``total_retries``).

    A fault (any exception but an input error, or no answer within ``timeout`` seconds, which bounds one attempt)
    is retried ``retries`` times with backoff ``backoff·2^k``, then ``RunStopped``. An input error
    (``is_input_error``: ValueError, or an HTTP 4xx status) raises ``RewardInputRejected`` at once, unretried.
    """

    def __init__(self, retries: int, backoff: float, timeout: float, sleep: Callable[[float], None] = time.sleep):
        self.retries, self.backoff, self.timeout, self.sleep = retries, backoff, timeout, sleep
        self.total_retries = 0

    def __call__(self, fn: Callable, *args, what: str = "reward", **kwargs):
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            try:
                return _call_with_timeout(fn, args, kwargs, self.timeout)
            except Exception as e:  # any failure of user code but an input error is retried; KeyboardInterrupt is not
                last = e
                if isinstance(e, RewardInputRejected):  # from a nested RetryingCall: already one line
                    raise
                if is_input_error(e):
                    msg = " ".join(f"{type(e).__name__}: {e}".split())
                    raise RewardInputRejected(
                        f"{what} rejected its input, not retried (the same input fails the same way): {msg}. The "
                        "last checkpoint is intact; fix the input (image size, prompts, metadata) or the reward's "
                        "options and resume"
                    ) from e
                if attempt == self.retries:
                    break
                delay = self.backoff * (2 ** attempt)
                self.total_retries += 1
                print(f"warning: {what} failed (attempt {attempt + 1} of {self.retries + 1}: {type(e).__name__}: "
                      f"{e}); retrying in {delay:.3g} s", file=sys.stderr, flush=True)
                if delay > 0:
                    self.sleep(delay)
        raise RunStopped(
            f"{what} failed {self.retries + 1} times (faults.reward_retries={self.retries}); last error: "
            f"{type(last).__name__}: {last}. The last checkpoint is intact; fix the reward and resume"
        ) from last


class StopSignal:
    """Context manager: the first SIGTERM/SIGINT sets ``requested`` (finish the iteration, checkpoint, exit 0);
    a second one restores the default handler and re-delivers the signal. No-op outside the main thread."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.requested: str | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested is not None:
            self.__exit__()
            os.kill(os.getpid(), signum)
            return
        self.requested = name
        print(
            f"received {name}: finishing this iteration, then checkpoint and exit (send again to abort now)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self):
        if self.enabled and threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
        return False
