"""Rank health: which rank failed, and where, when a collective fails or times out.

A collective that fails because a peer died, raised or hung tells the survivors only that *some*
connection closed or timed out. To name the culprit, every rank keeps a small record in the
process group's key-value store (the c10d store of the default group, reachable by every rank and,
under torch's elastic launcher, hosted by the launcher itself so it outlives the ranks):

=================================  ================================================================
``autotp/health/<rank>/pid``       ``host:pid`` of the rank's process, written once at start
``autotp/health/<rank>/beat``      ``seq|time|phase|collectives|step``, rewritten every ``interval`` s
                                   by a daemon thread, and at once on a change of phase
``autotp/health/<rank>/failed``    ``phase|reason`` (``reason`` starts with ``secondary:`` when the
                                   rank itself only saw another rank fail)
=================================  ================================================================

*phase* is a short word the entry points set (``loading``, ``loaded``, ``generate``); *step* counts
the calls of the parallelized model's forward; *collectives* is how many collectives the rank has
entered (:attr:`autotp.collectives.Comm.issued`). The heartbeat thread reads step and collectives,
so the hot path pays nothing but an integer increment.

:meth:`RankHealth.diagnose`, run by a survivor after a failed collective, classifies each other
rank, in this order of blame:

1. it reported a failure of its own (an exception at an entry point, or an uncaught one);
2. its process is gone (same host: ``/proc/<pid>`` missing or a zombie), or its heartbeat stopped
   advancing for ``stale_after`` seconds (another host);
3. it is alive but has entered fewer collectives than the survivor (a hang: it never reached the
   collective the others wait in).

Failures that a rank recorded as *secondary* (it only saw a peer fail) are reported after the
primary ones. The store may itself be gone (e.g. rank 0 hosted it and died); every store access is
guarded and the diagnosis then says so instead of raising.

This module never calls ``torch.distributed``: it is handed a store object (``set``/``get``/
``check``, as ``torch.distributed.Store``), which keeps it testable with a single-process
``HashStore``; :func:`autotp.collectives.default_store` finds the default group's store.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from autotp.errors import AutoTPError

__all__ = ["RankFailure", "RankHealth", "Suspect"]

_PREFIX = "autotp/health"


class RankFailure(AutoTPError):
    """Another rank died, raised or stopped responding; the message names it (when it could be
    found) and the phase it last reported. ``ranks`` lists the ranks blamed."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


@dataclasses.dataclass(frozen=True)
class Suspect:
    """A rank the diagnosis blames: ``kind`` is ``failed``, ``secondary``, ``dead``, ``silent``
    (heartbeat stopped) or ``behind`` (alive, fewer collectives)."""

    rank: int
    kind: str
    phase: str
    detail: str = ""

    def describe(self) -> str:
        where = f"in phase '{self.phase}'" if self.phase else "before it reported any phase"
        if self.kind == "failed":
            return f"rank {self.rank} raised {where}: {self.detail}"
        if self.kind == "secondary":
            return f"rank {self.rank} also saw a failure {where}"
        if self.kind == "dead":
            return f"rank {self.rank} died {where} (its process is gone: killed, crashed or out of memory)"
        if self.kind == "silent":
            return f"rank {self.rank} stopped responding {where} ({self.detail})"
        return f"rank {self.rank} is alive but stuck {where} ({self.detail})"


def _decode(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class RankHealth:
    """This rank's health record in ``store`` and the diagnosis of the others'.

    ``collectives`` returns how many collectives this rank has entered (read by the heartbeat
    thread). :meth:`start` writes the pid record, starts the daemon heartbeat thread and chains a
    ``sys.excepthook`` that records an uncaught exception as this rank's failure; :meth:`stop`
    undoes all three (idempotent, also registered with ``atexit`` by the entry points' callers).
    """

    def __init__(self, store: Any, rank: int, world_size: int, *, interval: float = 0.5,
                 collectives: Callable[[], int] | None = None, prefix: str = _PREFIX) -> None:
        if interval <= 0:
            raise AutoTPError(f"heartbeat interval must be positive, got {interval}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        self.collectives = collectives or (lambda: 0)
        self.prefix = prefix
        self.phase = "starting"
        #: forward calls so far (set by the caller, published with the next heartbeat)
        self.step = 0
        self.host = socket.gethostname()
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous_hook: Any = None
        self.store_error: str | None = None  # set when the store stopped answering

    # -- keys -------------------------------------------------------------------------------------

    def _key(self, rank: int, what: str) -> str:
        return f"{self.prefix}/{rank}/{what}"

    def _set(self, key: str, value: str) -> bool:
        try:
            self.store.set(key, value)
            return True
        except Exception as e:  # noqa: BLE001 - the store host may be gone; health is best effort
            self.store_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            return False

    def _get(self, key: str) -> str | None:
        """The key's value, or None when it does not exist (never blocks waiting for it)."""
        try:
            if not self.store.check([key]):
                return None
            return _decode(self.store.get(key))
        except Exception as e:  # noqa: BLE001
            self.store_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            return None

    # -- this rank --------------------------------------------------------------------------------

    def start(self) -> RankHealth:
        """Write the pid record and the first beat; start the heartbeat thread and the except hook."""
        self._set(self._key(self.rank, "pid"), f"{self.host}:{os.getpid()}")
        self.beat()
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"autotp-heartbeat-{self.rank}", daemon=True)
            self._thread.start()
        if self._previous_hook is None:
            self._previous_hook = sys.excepthook
            sys.excepthook = self._excepthook
        return self

    def stop(self) -> None:
        """Stop the heartbeat thread (waits for it) and restore ``sys.excepthook``."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(2 * self.interval, 1.0))
        if self._previous_hook is not None:
            if sys.excepthook == self._excepthook:
                sys.excepthook = self._previous_hook
            self._previous_hook = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def set_phase(self, phase: str, publish: bool = True) -> None:
        """Say what this rank is doing; ``publish`` writes it now (coarse phases), otherwise the
        next heartbeat carries it (per-call phases on the hot path)."""
        self.phase = phase
        if publish:
            self.beat()

    def beat(self) -> bool:
        """Write one heartbeat now."""
        with self._lock:
            self._seq += 1
            try:
                issued = int(self.collectives())
            except Exception:  # noqa: BLE001 - a counter read must never kill the heartbeat
                issued = -1
            value = f"{self._seq}|{time.time():.3f}|{self.phase.replace('|', '/')}|{issued}|{self.step}"
        return self._set(self._key(self.rank, "beat"), value)

    def record_failure(self, exc: BaseException | str, secondary: bool | None = None) -> None:
        """Record that this rank failed (``exc``: the exception or a reason), in the current phase.
        ``secondary`` (default: ``exc`` is a :class:`RankFailure`) says it only saw another rank fail."""
        if secondary is None:
            secondary = isinstance(exc, RankFailure)
        if isinstance(exc, BaseException):
            first = str(exc).splitlines()[0] if str(exc) else ""
            reason = f"{type(exc).__name__}: {first}"[:500]
        else:
            reason = str(exc)[:500]
        self._set(self._key(self.rank, "failed"),
                  f"{self._where(self.phase, self.step).replace('|', '/')}|{'secondary: ' if secondary else ''}"
                  f"{reason}")
        self.beat()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self.beat():
                return  # the store is gone (the launcher or rank 0 exited): nothing left to tell

    def _excepthook(self, exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not issubclass(exc_type, KeyboardInterrupt):
            self.record_failure(exc)
        hook = self._previous_hook or sys.__excepthook__
        self.stop()
        hook(exc_type, exc, tb)

    # -- the others -------------------------------------------------------------------------------

    @staticmethod
    def _where(phase: str, step: int) -> str:
        return f"{phase}, forward call {step}" if step else phase

    def _read(self, rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": rank}
        beat = self._get(self._key(rank, "beat"))
        if beat is not None:
            seq, stamp, phase, issued, step = (beat.split("|") + ["", "", "", "", ""])[:5]
            out.update(seq=int(seq or 0), time=float(stamp or 0), phase=self._where(phase, int(step or 0)),
                       issued=int(issued or -1))
        pid = self._get(self._key(rank, "pid"))
        if pid is not None:
            host, _, number = pid.rpartition(":")
            out.update(host=host, pid=int(number or 0))
        failed = self._get(self._key(rank, "failed"))
        if failed is not None:
            phase, _, reason = failed.partition("|")
            out.update(failed=reason, failed_phase=phase)
        return out

    def _process_gone(self, info: dict[str, Any]) -> bool | None:
        """True / False when the rank runs on this host (``/proc``), None when that cannot be told."""
        if info.get("host") != self.host or not info.get("pid") or not os.path.isdir("/proc"):
            return None
        try:
            with open(f"/proc/{info['pid']}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return True
        return state in ("Z", "X")  # a zombie: dead, its parent has not reaped it yet

    def diagnose(self, stale_after: float | None = None) -> list[Suspect]:
        """Which other ranks failed, blamed in the order of the module docstring (empty when none
        can be found). Waits at most ``stale_after`` seconds (default ``4 * interval``) for
        heartbeats to show which ranks are silent and for a rank of this host to be seen gone, and
        only when no rank is blamed otherwise (so a rank that hangs is blamed after that wait)."""
        stale_after = 4 * self.interval if stale_after is None else stale_after
        others = [r for r in range(self.world_size) if r != self.rank]
        self.store_error = None
        infos = {r: self._read(r) for r in others}
        mine = int(self.collectives())
        primary: list[Suspect] = []
        secondary: list[Suspect] = []
        for r, info in infos.items():
            if "failed" in info:
                reason: str = info["failed"]
                if reason.startswith("secondary: "):
                    secondary.append(Suspect(r, "secondary", info["failed_phase"], reason[len("secondary: "):]))
                else:
                    primary.append(Suspect(r, "failed", info["failed_phase"], reason))
        blamed = {s.rank for s in primary}
        for r, info in infos.items():
            if r not in blamed and self._process_gone(info):
                primary.append(Suspect(r, "dead", info.get("phase", ""), "process gone"))
                blamed.add(r)
        if self.store_error is not None:  # heartbeats cannot be read: blame no one on their account
            return sorted(primary, key=lambda s: s.rank) + sorted(secondary, key=lambda s: s.rank)
        if not primary and stale_after > 0:
            # ranks on other hosts: which heartbeats stop advancing; ranks on this host: whether the
            # process goes (a SIGKILL-ed rank's sockets close while it exits, before /proc shows it
            # dead, so the survivor's collective can fail first: seen once in the suite, blamed as
            # "behind" in phase 'generate, forward call 1')
            gone = {r: self._process_gone(infos[r]) for r in others}
            unknown = [r for r in others if gone[r] is None]
            local = [r for r in others if gone[r] is False]
            deadline = time.monotonic() + stale_after
            seen = {r: infos[r].get("seq") for r in unknown}
            while (unknown or local) and time.monotonic() < deadline:
                time.sleep(min(self.interval / 5, max(deadline - time.monotonic(), 0)))
                for r in list(unknown):
                    now = self._read(r)
                    if now.get("seq") != seen[r]:
                        unknown.remove(r)
                for r in list(local):
                    if self._process_gone(infos[r]):
                        primary.append(Suspect(r, "dead", infos[r].get("phase", ""), "process gone"))
                        local.remove(r)
            for r in unknown:
                primary.append(Suspect(r, "silent", infos[r].get("phase", ""),
                                       f"no heartbeat for {stale_after:.1f} s"))
        if not primary:
            for r, info in infos.items():
                issued = info.get("issued", -1)
                if 0 <= issued < mine and r not in {s.rank for s in secondary}:
                    primary.append(Suspect(r, "behind", info.get("phase", ""),
                                           f"it entered {issued} collectives, rank {self.rank} {mine}: it never "
                                           "reached the collective the others wait in"))
        return sorted(primary, key=lambda s: s.rank) + sorted(secondary, key=lambda s: s.rank)

    def failure(self, during: str, cause: BaseException | str, stale_after: float | None = None) -> RankFailure:
        """A :class:`RankFailure` for a collective that failed with ``cause`` while ``during``,
        naming the ranks :meth:`diagnose` blames."""
        return rank_failure(self.rank, self.world_size, during, cause, self.diagnose(stale_after), self.store_error)


def rank_failure(rank: int, world_size: int, during: str, cause: BaseException | str,
                 suspects: list[Suspect], store_error: str | None = None) -> RankFailure:
    """The message of a failed collective, given what the diagnosis found."""
    text = str(cause).splitlines()[0][:300] if str(cause) else type(cause).__name__
    primary = [s for s in suspects if s.kind != "secondary"]
    if primary:
        names = ", ".join(f"rank {s.rank}" for s in primary)
        what = "; ".join(s.describe() for s in primary)
        fix = f"Check the log of {names} for its first error"
        if any(s.kind in ("dead", "silent") for s in primary):
            fix += " (a process killed by signal 9 with no error of its own is usually the out-of-memory killer)"
        if any(s.kind == "behind" for s in primary):
            fix += "; a rank stuck outside a collective hangs the others until the process-group timeout"
        head = f"rank {rank} of {world_size}: {names} failed while {during}: {what}."
    else:
        why = f" (the health store is unreachable: {store_error}; rank 0 may have hosted it and died)" \
            if store_error else ""
        head = (f"rank {rank} of {world_size}: another rank failed or stopped responding while {during}, and "
                f"which one could not be told{why}.")
        fix = "The first error in the other ranks' logs is the cause"
    return RankFailure(f"{head} {fix}. (collective error: {text})",
                       ranks=tuple(s.rank for s in primary))
