"""Data parallel training over several trainer processes: rank 0 leads, the others follow.

Start every rank with the same module, ``torchrun --nproc_per_node=N -m services.trainer``
(or ``deepspeed --num_gpus N --module services.trainer``); one process, the default,
needs no launcher. Rank 0 is the trainer service exactly as in one process (gRPC, Redis,
the job loop), except that its Policy is a ``LeaderPolicy``: every public method call is
first broadcast to the other ranks, then made locally. The other ranks run ``follow``:
they never touch Redis, and make each call they receive on their own Policy, so that
DeepSpeed's collectives (gradient reduction, ZeRO-3 gathers, checkpoint saves) line up
on every rank. Inside an optimiser step each rank runs its share of the micro-batches
(``distributed.share_of``), the loss scaled so that DeepSpeed's average over ranks is the
gradient of the whole batch, and the step's totals are summed over ranks (``distributed.sum_over_ranks``).

Commands go over torch.distributed's default group (``broadcast_object_list``); after
each one every rank reports its error or None, so a failure on any rank fails the call
on rank 0 (with that rank's message). One lock orders commands and pings: an idle
leader pings every quarter of the collective timeout, so a follower whose leader died
or hangs gives up within the timeout instead of waiting forever.
"""

from __future__ import annotations

import inspect
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from services.trainer.distributed import rank, size
from services.trainer.policy import Policy

log = logging.getLogger(__name__)

T = TypeVar("T")

PING = ("ping",)
EXIT = ("exit",)


def _broadcast(command: tuple[Any, ...] | None) -> tuple[Any, ...]:
    holder: list[Any] = [command]
    dist.broadcast_object_list(holder, src=0)
    return cast(tuple[Any, ...], holder[0])


def _gather_errors(error: str | None) -> list[str | None]:
    found: list[str | None] = [None] * size()
    dist.all_gather_object(found, error)
    return found


class Leader:
    """Rank 0's side: sends commands to the other ranks, and pings them while idle."""

    def __init__(self, timeout_s: float) -> None:
        self.ping_every_s = timeout_s / 4
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._stopped = threading.Event()
        self._pinger = threading.Thread(target=self._ping, name="trainer-leader-ping", daemon=True)

    def start(self) -> None:
        self._pinger.start()

    def execute(self, command: tuple[Any, ...], local: Callable[[], T]) -> T:
        """Send ``command``, run ``local`` here, then collect every rank's outcome."""
        with self._lock:
            _broadcast(command)
            try:
                result = local()
            except BaseException as err:
                self._settle(f"{type(err).__name__}: {err}")
                raise
            failures = [(r, e) for r, e in enumerate(self._settle(None)) if e is not None]
        if failures:
            raise RuntimeError("; ".join(f"trainer rank {r}: {e}" for r, e in failures))
        return result

    def _settle(self, own: str | None) -> list[str | None]:
        try:
            return _gather_errors(own)
        finally:
            self._last_sent = time.monotonic()

    def close(self) -> None:
        """Tell the other ranks to exit (after the command in progress, if any)."""
        self._stopped.set()
        with self._lock:
            try:
                _broadcast(EXIT)
            except RuntimeError as err:  # a rank is gone already; the launcher ends the rest
                log.warning("could not tell the other trainer ranks to exit: %s", err)

    def _ping(self) -> None:
        while not self._stopped.wait(min(self.ping_every_s, 1.0)):
            if not self._lock.acquire(timeout=1.0):
                continue  # a command is running: the followers are busy with it
            try:
                if not self._stopped.is_set() and time.monotonic() - self._last_sent >= self.ping_every_s:
                    _broadcast(PING)
                    self._last_sent = time.monotonic()
            except Exception:
                log.exception("pinging the other trainer ranks failed; they will time out")
                return
            finally:
                self._lock.release()


class LeaderPolicy:
    """Rank 0's Policy: each public method call is made on every rank (see the module doc).
    Attributes (engine, tokenizer, spec, ...) are rank 0's own."""

    def __init__(self, leader: Leader, policy: Policy) -> None:
        self._leader = leader
        self._policy = policy

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._policy, name)
        if name.startswith("_") or not (inspect.ismethod(value) and value.__self__ is self._policy):
            return value

        def on_every_rank(*args: Any, **kwargs: Any) -> Any:
            return self._leader.execute(("call", name, args, kwargs), lambda: value(*args, **kwargs))

        return on_every_rank


_leader: Leader | None = None


def start_leader(timeout_s: float) -> Leader:
    """Rank 0 of several: the Leader every Policy of this process goes through."""
    global _leader
    _leader = Leader(timeout_s)
    _leader.start()
    return _leader


def load_policy(**arguments: Any) -> Policy:
    """``Policy.load(**arguments)`` on this rank, and on every other rank when this is a leader."""
    if _leader is None:
        return Policy.load(**arguments)
    policy = _leader.execute(("load", arguments), lambda: Policy.load(**arguments))
    return cast(Policy, LeaderPolicy(_leader, policy))


def follow(device: torch.device) -> None:
    """A rank above 0: make rank 0's calls on this rank's Policy until rank 0 says exit.

    SIGINT and SIGTERM are left to rank 0, which ends the step in progress and then tells
    this rank to exit; if rank 0 dies instead, the next collective fails and so does this.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: log.info("signal %d: waiting for rank 0 to stop", signum))
    policy: Policy | None = None
    log.info("trainer rank %d of %d following rank 0 (device %s)", rank(), size(), device)
    while (command := _broadcast(None)) != EXIT:
        if command == PING:
            continue
        error: str | None = None
        try:
            if command[0] == "load":
                if policy is not None:
                    policy.close()
                policy = None
                policy = Policy.load(**(command[1] | {"device": device}))
            elif policy is None:
                raise RuntimeError(f"{command[1]} called before any policy was loaded")
            else:
                getattr(policy, command[1])(*command[2], **command[3])
        except Exception as err:
            log.exception("command %s failed", command[:2] if command[0] == "call" else "load")
            error = f"{type(err).__name__}: {err}"
        _gather_errors(error)
    log.info("trainer rank %d: rank 0 says exit", rank())
