"""Multi-process harness for distributed tests: ``run_ranks(fn, world_size, *args, **kwargs)``.

Each rank is a fresh process with ``torch.set_num_threads(1)`` and a gloo default
process group rendezvoused through a TCP store that the parent hosts on a port the OS picks
(``127.0.0.1:0``): no fixed ports, no races on a "free" port. ``fn(rank, world_size, *args,
**kwargs)`` runs in every rank; the return values come back in rank order. A rank that raises makes
``run_ranks`` raise :class:`RankError` with the traceback of the first rank that failed (by the
time it caught the exception); a rank that dies or hangs is noticed by polling (process sentinels and result pipes) and the remaining ranks are killed, so a
test never hangs past ``timeout``.

``fn`` must be a module-level function (it is pickled by qualified name); its arguments and
return value must be picklable.

Each rank sends its CPU seconds (user + sys) back with its message, and :data:`RANK_CPU` sums
them in the calling process: forked from the forkserver, ranks are not the caller's children, so
neither ``getrusage(RUSAGE_CHILDREN)`` nor ``/usr/bin/time`` sees them (``conftest.py``'s
``--cpu-per-file`` adds them to each test's own CPU).

Ranks are forked from a ``forkserver`` that imported torch, Dynamo, transformers and autotp once
per session (:data:`PRELOAD`): a ``spawn``-ed rank spent ~5 s of CPU importing them, in every
rank of every test, before doing anything. A forked rank is still a fresh process (the server only
imports and fills pure caches, never runs a model, so no state of one test reaches another), and it gets the caller's
environment as it is at ``run_ranks`` time (tests set ``HF_HUB_OFFLINE``, ``AUTOTP_CACHE_DIR``
...), with ``AUTOTP_TRACE_ONCE=1`` unless the caller set it (:func:`_rank_environment`: one rank
traces, the others install its frames); settings the preloaded libraries read from the environment
at import are read again (:func:`_apply_environment`).
"""

from __future__ import annotations

import datetime
import multiprocessing.connection as mpc
import os
import pickle
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests._probe import PROBE_LOG, RankProbe, process_cpu_s
from tests._tiny import ARCHS

__all__ = ["RANK_CPU", "RankCpu", "RankError", "run_ranks"]

_HOST = "127.0.0.1"
#: after the first failure, how long the other ranks get to report their own error before they
#: are killed (they are usually blocked in a collective that will never complete)
_GRACE_S = 2.0
#: modules the forkserver imports once, so that ranks forked from it start with them loaded: the
#: compile stack (with what a first compile imports lazily), transformers and the modeling code of
#: every tiny architecture (``tests/_tiny.py: ARCHS``), autotp. First the CLI's rank-server module
#: (``autotp/_rank_server.py``: no collection while importing, the heap frozen at each fork), last
#: ``tests/_warm_rank_server.py`` (the per-process caches of a first compile, filled once)
PRELOAD = [
    "autotp._rank_server", "torch", "torch.distributed", "torch._dynamo", "torch._dynamo.backends.debugging",
    "torch._functorch.aot_autograd", "torch._functorch.compilers", "torch.fx.experimental.proxy_tensor",
    "torch._subclasses.fake_tensor", "torch.export", "sympy.combinatorics",
    "transformers", "transformers.generation.utils",
    *(f"transformers.models.{arch}.modeling_{arch}" for arch in ARCHS),
    "autotp", "autotp.api", "autotp.planner", "tests._tiny", "tests._warm_rank_server",
]


def _context() -> Any:
    """The multiprocessing context ranks start from: a forkserver with :data:`PRELOAD` imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first rank of the session)
    return ctx


def _rank_environment() -> dict[str, str]:
    """The ranks' environment: the caller's, with ``AUTOTP_TRACE_ONCE=1`` unless it says otherwise
    (the ranks share traced frames, ``autotp/shared_frames.py``: the suite's ranks share cores with
    each other and with the other xdist workers, where one rank tracing for all pays; a test of the
    per-rank path sets it to 0, in its own environment or the rank's)."""
    env = dict(os.environ)
    env.setdefault("AUTOTP_TRACE_ONCE", "1")
    return env


def _apply_environment(env: dict[str, str]) -> None:
    """Make this rank's environment the caller's: a forked rank inherits the forkserver's, which
    is the environment of the session's first ``run_ranks``. huggingface_hub reads
    ``HF_HUB_OFFLINE`` at import (the server imported it): read it again."""
    os.environ.clear()
    os.environ.update(env)
    from huggingface_hub import constants

    offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    constants.HF_HUB_OFFLINE = offline.upper() in constants.ENV_VARS_TRUE_VALUES  # as constants.py reads it


class RankCpu:
    """CPU seconds (user + sys) that the ranks :func:`run_ranks` started in this process spent, as
    each reported when it finished (a rank that died reports nothing)."""

    def __init__(self) -> None:
        self.total_s = 0.0


#: the ranks of this process (a pytest-xdist worker has its own)
RANK_CPU = RankCpu()


class RankError(RuntimeError):
    """A rank raised, died or timed out; the message carries its rank and traceback text."""


def _child(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    env: dict[str, str],
    conn: mpc.Connection,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    failed_at: float | None = None
    try:
        _apply_environment(env)
        torch.set_num_threads(1)
        probe = RankProbe(env[PROBE_LOG], fn, rank, world_size) if env.get(PROBE_LOG) else None
        store = dist.TCPStore(
            _HOST, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            result = fn(rank, world_size, *args, **kwargs)
        except BaseException:
            failed_at = time.time()  # before tearing down the group makes the peers fail too
            raise
        finally:
            dist.destroy_process_group()
        if probe is not None:
            probe.write()
        payload = pickle.dumps(("ok", process_cpu_s(), result))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        failed_at = failed_at or time.time()
        tb = traceback.format_exc()
        try:
            err = pickle.dumps(exc)
            pickle.loads(err)
        except Exception:  # noqa: BLE001 - the exception itself may not pickle
            err = None
        payload = pickle.dumps(("err", process_cpu_s(), tb, err, failed_at))
    conn.send_bytes(payload)
    conn.close()


def _loads(data: bytes) -> Any:
    """Unpickle a child's message; a value the parent cannot rebuild becomes an error report."""
    try:
        return pickle.loads(data)
    except Exception:  # noqa: BLE001 - e.g. a class the parent cannot import
        return ("err", 0.0, f"the parent could not unpickle a rank's message:\n{traceback.format_exc()}",
                None, time.time())


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 900, **kwargs: Any
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return the
    per-rank results in rank order. Raises :class:`RankError` on a child exception, death or
    timeout (after killing the remaining ranks)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    # The parent hosts the rendezvous store; port 0 lets the OS pick a free one.
    store = dist.TCPStore(
        _HOST, 0, world_size, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    procs: list[Any] = []
    conns: list[mpc.Connection] = []
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_child,
            args=(rank, world_size, store.port, timeout, _rank_environment(), send, fn, args, kwargs),
            name=f"rank{rank}",
            daemon=True,
        )
        p.start()
        send.close()  # the child holds its own copy; EOF on recv then means the child is gone
        procs.append(p)
        conns.append(recv)

    results: dict[int, Any] = {}
    errors: dict[int, tuple[str, BaseException | None, float, bool]] = {}  # tb, exc, when, died
    deadline = time.monotonic() + timeout
    first_error_at: float | None = None
    try:
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline or (first_error_at is not None and now > first_error_at + _GRACE_S):
                break
            pending = [r for r in range(world_size) if r not in results and r not in errors]
            waitables: list[Any] = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
            ready = mpc.wait(waitables, timeout=min(0.5, max(0.0, deadline - now)))
            for r in pending:
                conn, proc = conns[r], procs[r]
                if conn in ready or proc.sentinel in ready:
                    try:
                        status, cpu_s, *rest = _loads(conn.recv_bytes())
                        RANK_CPU.total_s += cpu_s
                    except (EOFError, OSError):
                        proc.join(1)
                        msg = f"rank {r} died without a result (exit code {proc.exitcode})"
                        errors[r] = (msg, None, time.time(), True)
                    else:
                        if status == "ok":
                            results[r] = rest[0]
                        else:
                            tb, err, failed_at = rest
                            exc = _loads(err) if err is not None else None
                            exc = exc if isinstance(exc, BaseException) else None
                            errors[r] = (tb, exc, failed_at, False)
                    if r in errors and first_error_at is None:
                        first_error_at = time.monotonic()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for c in conns:
            c.close()
        del store

    missing = [r for r in range(world_size) if r not in results and r not in errors]
    if errors:
        # The cause: a rank that died, else the earliest exception. The others usually fail after
        # it, in a collective whose peer went away ("Connection reset by peer"); they are listed.
        order = sorted(errors, key=lambda r: (not errors[r][3], errors[r][2]))
        rank, others = order[0], order[1:]
        tb, exc, _, _ = errors[rank]
        note = f" (then ranks {others} failed too)" if others else ""
        note += f" (ranks {missing} were killed)" if missing else ""
        raise RankError(f"rank {rank} of {world_size} failed first{note}:\n{tb}") from exc
    if missing:
        raise RankError(f"ranks {missing} of {world_size} did not finish within {timeout} s; killed")
    return [results[r] for r in range(world_size)]
