"""The one home of communication: every ``torch.distributed`` call in autotp lives in this module.

Redistribution turns a tensor of one :mod:`placement <autotp.placement>` into another. Each kind is
an ``autograd.Function`` whose backward is the *conjugate* collective of its forward (the Megatron
pairs: identity / all-reduce, split / all-gather, reduce-scatter / all-gather, all-to-all / the
reverse all-to-all). All of them short-circuit at world size 1.

============================  ==============================  ================================================
``src -> dst``                forward                         backward
============================  ==============================  ================================================
``R -> R``                    identity                        identity, or all-reduce if ``grad_partial``
``P -> R``                    all-reduce (sum)                identity, or all-reduce if ``grad_partial``
``R -> S(d)``                 narrow to own chunk             all-gather along ``d``
``S(d) -> R``                 all-gather along ``d``          own chunk, or reduce-scatter if ``grad_partial``
``P -> S(d)``                 reduce-scatter along ``d``      all-gather along ``d``
``S(a) -> S(b)``              all-to-all (gather a, split b)  all-to-all (gather b, split a)
``S(d) -> S(d)``, ``P -> P``  identity                        identity
``R -> P``, ``S -> P``        unsupported (``AutoTPError``)
``R -> S(d/g)``               narrow to own group's chunk     unsupported (forward only)
``S(d/g) -> S(d)``            narrow within the group chunk   unsupported (forward only)
``S(d/g) -> R``               all-gather, one chunk a group   unsupported (forward only)
``R -> S(d:Hh)``              narrow to own heads             padded all-gather of the heads
``S(d:Hh) -> R``              padded all-gather of the heads  narrow (``grad_partial``: all-reduce, narrow)
============================  ==============================  ================================================

``S(d/g)`` is a :class:`~autotp.placement.GroupedShard` (kv heads when tp exceeds their count).
Its redistributions are inference-only: the solver offers grouped placements in graphs without a
backward, and their autograd Functions refuse a gradient. ``S(d:Hh)`` is a
:class:`~autotp.placement.HeadShard` (heads no tp divides, split in whole heads); it trains.

Why the backward is what it is: the gradient of a ``Replicate`` or ``Partial`` tensor is the full
logical gradient on every rank (``Replicate``); the gradient of a ``Shard(d)`` tensor is the same
shard of the logical gradient. ``grad_partial=True`` says that the gradient *arriving* at a
``Replicate`` output is itself a partial sum (its consumer produced a sharded or partial output,
e.g. the input of a column-parallel matmul), so it must be summed over the ranks on the way back.

Shards follow ``torch.chunk`` semantics (:func:`autotp.placement.chunk_range`). An uneven shard (a
vocabulary no tp divides: 50257 rows over 2 ranks are 25129 + 25128) is moved by the padded forms
only: ``S(d) -> R`` pads each rank's chunk to ``ceil(size / N)``, all-gathers, and trims the tail
(it needs the global ``size``, which the caller passes: a rank's chunk does not determine it);
``R -> S(d)`` narrows to the rank's chunk; a reduce-scatter pads the input to ``N * ceil(size /
N)`` and trims its output. The solver only offers uneven shards of vocabulary dims and never an
all-to-all onto or off one (which raises :class:`ShardingError`).

Backend support. NCCL runs every collective natively. On the torch 2.13 CPU build, gloo also
supports ``all_gather_single``, ``reduce_scatter_single`` and ``all_to_all_single`` natively
(checked at 2 and 4 ranks), with one quirk: gloo accepts only the *concatenated* layout
``(N*d0, ...)`` for the gathered output / scattered input, not the stacked ``(N, d0, ...)`` one, so
that is the layout used for every backend. gloo's list ``all_gather`` also takes non-contiguous
inputs on this build, but everything handed to a collective here is made contiguous anyway. Older or other gloo builds lack some of them; when a native call raises
"not supported" the :class:`Comm` remembers it and switches to an emulation: reduce-scatter as
all-reduce + narrow, all-to-all as all-gather + narrow, all-gather-into-tensor as the list
all-gather + cat. The backend rejects an unsupported op on every rank before any data moves, so
the fallback is symmetric. ``Comm(emulate=...)`` forces the emulations (used by the tests).

Accounting. ``Comm.counts`` counts collectives issued in *forward*, one per redistribution by
logical kind however it is implemented; ``Comm.bytes`` adds the payload bytes this rank handed to
each (the local input's ``nbytes``). ``Comm.backward_counts`` counts the backward collectives.

Failures. Every ``torch.distributed`` call runs inside ``_guard``, which counts it
(``Comm.issued``) and turns a failure caused by another rank (a closed or reset connection, a
timeout, ``DistError``) into a :class:`~autotp.health.RankFailure` that names the rank(s) that
died, raised or hung, from the rank-health records of :mod:`autotp.health` (:func:`attach_health`
starts them); other errors pass through unchanged.

The pure helpers :func:`kind_of`, :func:`backward_kind_of`, :func:`cost_bytes` and
:func:`is_supported` need no process group: the solver imports them.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import mmap
import os
import platform
import socket
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from autotp.errors import AutoTPError, ShardingError
from autotp.health import RankHealth, rank_failure
from autotp.placement import (
    GroupedShard,
    HeadShard,
    Partial,
    Placement,
    R,
    Replicate,
    Shard,
    StridedShard,
    chunk_range,
)

__all__ = [
    "KINDS",
    "Comm",
    "all_ranks",
    "backward_kind_of",
    "barrier",
    "broadcast_object",
    "attach_health",
    "cost_bytes",
    "default_store",
    "ensure_process_group",
    "is_peer_failure",
    "peer_failures",
    "process_health",
    "functional_redistribute",
    "is_supported",
    "kind_of",
    "redistribute",
    "reduce_over_ranks",
    "sum_over_ranks",
]

#: The logical collective kinds that :class:`Comm` counts.
KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


# --------------------------------------------------------------------------------------------------
# Process group
# --------------------------------------------------------------------------------------------------


class Comm:
    """A tensor-parallel group: a process group, this rank's index in it, and collective counters.

    ``group=None`` with ``world_size == 1`` is the single-process communicator (no process group);
    build it with :meth:`single`. With a real group, use :meth:`from_group` or
    :meth:`from_default_group`. Counters live on the instance; nothing here is global.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        *,
        emulate: Iterable[str] = (),
        simulated: bool = False,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise AutoTPError(f"invalid rank {rank} for world size {world_size}")
        if group is None and world_size > 1 and not simulated:
            raise AutoTPError(
                f"world size {world_size} needs a process group; use Comm.from_default_group() after "
                "ensure_process_group(), or Comm.single() for one process"
            )
        unknown = set(emulate) - {"all_gather", "reduce_scatter", "all_to_all"}
        if unknown:
            raise AutoTPError(f"cannot emulate {sorted(unknown)}; emulations exist for all_gather, "
                              "reduce_scatter and all_to_all")
        self.group = group
        self.rank = rank
        self.world_size = world_size
        #: no process group: collectives return shape-correct local stand-ins (see :meth:`simulated_group`)
        self.simulated = simulated
        #: kinds this communicator implements with other collectives (see module docstring)
        self.emulate: set[str] = set(emulate)
        #: forward collectives issued, by logical kind
        self.counts: collections.Counter[str] = collections.Counter()
        #: payload bytes this rank handed to forward collectives, by logical kind
        self.bytes: collections.Counter[str] = collections.Counter()
        #: backward collectives issued, by logical kind
        self.backward_counts: collections.Counter[str] = collections.Counter()
        #: every collective this rank entered (also barriers, broadcasts, emulation steps); never
        #: reset: the rank-health heartbeat publishes it so a survivor can tell who fell behind
        self.issued = 0
        #: this rank's health record (:mod:`autotp.health`), consulted when a collective fails
        self.health: RankHealth | None = None
        #: what the rank is doing, for failure messages ("the model was loading", ...)
        self.during = ""
        #: CPU all-reduces and small all-gathers through shared memory instead of the process group
        #: (:class:`SharedMemoryCollectives`, :meth:`use_shared_memory`); None: the group does them
        self.shared_memory: SharedMemoryCollectives | None = None
        #: groups count -> the process group of the ranks holding this rank's chunk of a grouped shard
        #: (:func:`chunk_group`), made once per count
        self.chunk_groups: dict[int, dist.ProcessGroup] = {}

    @classmethod
    def single(cls) -> Comm:
        """The world-size-1 communicator: every redistribution is local, no process group needed."""
        return cls(None, 0, 1)

    @classmethod
    def simulated_group(cls, world_size: int, rank: int = 0) -> Comm:
        """A planning communicator: ``world_size`` ranks seen from ``rank`` in one process, no group.

        Collectives are counted exactly as on a real group, and return tensors of the right local
        shape (a sum over ranks is this rank's value, a gather repeats this rank's chunk). The
        values are meaningless; this is for running a rewritten graph on the meta device, where
        only shapes, counts and bytes exist (``autotp plan``).
        """
        return cls(None, rank, world_size, simulated=True)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup, *, emulate: Iterable[str] = ()) -> Comm:
        """Wrap an existing process group."""
        return cls(group, dist.get_rank(group), dist.get_world_size(group), emulate=emulate)

    @classmethod
    def from_default_group(cls, *, emulate: Iterable[str] = ()) -> Comm:
        """Wrap the default (world) process group, which must already be initialized."""
        if not dist.is_available() or not dist.is_initialized():
            raise AutoTPError(
                "torch.distributed is not initialized; call autotp.collectives.ensure_process_group() "
                "under torchrun, or use Comm.single() for one process"
            )
        group = dist.group.WORLD
        assert group is not None  # guaranteed once initialized
        return cls.from_group(group, emulate=emulate)

    @property
    def backend(self) -> str | None:
        """The process group's backend name (``"gloo"``, ``"nccl"``), or None for a single process."""
        return None if self.group is None else str(dist.get_backend(self.group))

    @property
    def timeout(self) -> datetime.timedelta | None:
        """How long one of this group's collectives waits for the others before it fails (the
        group's ``timeout=``); None for a single process or a simulated group, and where torch does
        not say (``compat.group_timeout``)."""
        if self.group is None:
            return None
        from autotp.compat import group_timeout

        return group_timeout(self.group, "cuda" if "nccl" in (self.backend or "") else "cpu")

    def use_shared_memory(self, capacity: int = 256 * 1024, timeout_s: float = 1800.0) -> bool:
        """Do this group's CPU all-reduces (in ``capacity``-byte pieces) and all-gathers of at most
        ``capacity`` bytes per rank through one shared-memory segment when every rank runs on this
        host (:class:`SharedMemoryCollectives`); collective: every rank must call it. Returns
        whether it is on (False: one process, a simulated group, ranks on several hosts, a host
        without libatomic's fence, or a CPU other than x86-64: the protocol is fenced and portable,
        but tested on x86-64 only)."""
        if self.group is None or self.world_size == 1 or self.shared_memory is not None:
            return self.shared_memory is not None
        hosts: list[Any] = [None] * self.world_size
        usable = memory_fence() is not None and os.path.isdir("/dev/shm")  # every rank must agree
        with _guard(self, "all_gather_object"):
            dist.all_gather_object(hosts, (socket.gethostname(), platform.machine(), usable), group=self.group)
        if len(set(hosts)) != 1 or hosts[0][1] not in ("x86_64", "AMD64") or not hosts[0][2]:
            return False
        self.shared_memory = SharedMemoryCollectives(self, capacity, timeout_s)
        return True

    def reset_counts(self) -> None:
        """Zero all counters."""
        self.counts.clear()
        self.bytes.clear()
        self.backward_counts.clear()

    def _record(self, kind: str, x: Tensor, backward: bool) -> None:
        if backward:
            self.backward_counts[kind] += 1
        else:
            self.counts[kind] += 1
            self.bytes[kind] += x.numel() * x.element_size()

    def __copy__(self) -> Comm:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Comm:
        # A communicator is a handle on a process group, shared by every module that holds it:
        # copying a GraphModule that contains Redistribute modules must not try to copy the group.
        return self

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, world_size={self.world_size}, backend={self.backend})"


#: the collective timeout of a process group autotp starts (:func:`ensure_process_group`), and the
#: least under which ``torch.compile(backend="autotp")`` lets rank 0 plan for the group
#: (``backend.waits_for_a_plan``)
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def ensure_process_group(
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Initialize the default process group from the launcher's environment, unless one exists.

    ``timeout`` (default 10 minutes) bounds every collective and the rendezvous: when a rank dies
    or hangs, the others raise after it instead of waiting forever (gloo raises at once when a
    peer's connection closes). It cannot change a group that already exists.

    The launcher (``torchrun``) sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``;
    ``init_method="env://"`` reads them. ``backend=None`` picks NCCL when CUDA is available and
    ``device`` is a CUDA device (or not given), gloo otherwise. With NCCL, this rank's GPU is
    ``LOCAL_RANK`` (or the given CUDA device).
    """
    if not dist.is_available():
        raise AutoTPError("this torch build has no torch.distributed; install a build with it")
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise AutoTPError(
            f"no process group and no launcher environment (missing {', '.join(missing)}); start the "
            "program with `torchrun --nproc-per-node N ...`, or use Comm.single() for one process"
        )
    dev = torch.device(device) if device is not None else None
    if backend is None:
        use_cuda = torch.cuda.is_available() and (dev is None or dev.type == "cuda")
        backend = "nccl" if use_cuda else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        if dev is None or dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    dist.init_process_group(backend=backend, init_method="env://", timeout=timeout, **kwargs)


def broadcast_object(obj: Any, comm: Comm, src: int = 0) -> Any:
    """Return the group's rank-``src`` value of ``obj`` on every rank (must be picklable)."""
    if comm.world_size == 1 or comm.simulated:
        return obj
    box = [obj]
    with _guard(comm, "broadcast"):
        dist.broadcast_object_list(box, group=comm.group, group_src=src)
    return box[0]


def all_ranks(ok: bool, comm: Comm) -> bool:
    """Whether ``ok`` holds on every rank of the group (a one-integer all-reduce; not counted
    among the forward's collectives)."""
    if comm.world_size == 1 or comm.simulated:
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in (comm.backend or "") else None
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    with _guard(comm, "all-reduce"):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=comm.group)
    return int(flag.item()) == 0


def sum_over_ranks(x: Tensor, comm: Comm) -> Tensor:
    """The sum of ``x`` over the group's ranks, on every rank (no autograd; counted as an all-reduce)."""
    return reduce_over_ranks(x, comm, "sum")


def reduce_over_ranks(x: Tensor, comm: Comm, op: str = "sum", *, backward: bool = False) -> Tensor:
    """Elementwise ``op`` (``"sum"`` or ``"max"``) of ``x`` over the group's ranks, on every rank.

    No autograd: layers that reduce inside their own ``autograd.Function`` (the sharded softmax's
    row statistics) call it in forward, and with ``backward=True`` in backward, where it is counted
    under ``Comm.backward_counts``. Counted as an all-reduce.
    """
    if op not in ("sum", "max"):
        raise AutoTPError(f"reduce_over_ranks: op must be 'sum' or 'max', got {op!r}")
    if comm.world_size == 1:
        return x
    return _all_reduce(x, comm, backward=backward, op=op)


def barrier(comm: Comm) -> None:
    """Wait until every rank of the group gets here."""
    if comm.world_size > 1 and not comm.simulated:
        with _guard(comm, "barrier"):
            dist.barrier(group=comm.group)


def default_store() -> Any:
    """The c10d key-value store of the default process group (None without one): the rank-health
    records (:mod:`autotp.health`) live there."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


#: One health record per process and store (the default group's): several models loaded in one
#: process share it. The only process-wide state in this module.
_HEALTH: dict[int, RankHealth] = {}
_HEALTH_COMMS: weakref.WeakSet[Comm] = weakref.WeakSet()


def attach_health(comm: Comm, interval: float = 0.5) -> RankHealth | None:
    """Give ``comm`` this process's health record on the default group's store (started on first
    use: pid record, daemon heartbeat thread, except hook; see :mod:`autotp.health`). None at world
    size 1, for a simulated group, or without a store."""
    if comm.world_size == 1 or comm.simulated:
        return None
    store = default_store()
    if store is None:
        return None
    # records are keyed by the rank in the default group, whose store holds them: with a device
    # mesh, ``comm`` is a sub-group (tp) whose ranks repeat across the mesh
    rank, world_size = dist.get_rank(), dist.get_world_size()
    health = _HEALTH.get(id(store))
    if health is None or health.store is not store or health.world_size != world_size:
        for old in _HEALTH.values():
            old.stop()
        _HEALTH.clear()
        _HEALTH_COMMS.clear()
        comms = _HEALTH_COMMS
        # collectives entered by every communicator of this process, summed (ranks that do the
        # same work have the same sum)
        health = RankHealth(store, rank, world_size, interval=interval,
                            collectives=lambda: sum(c.issued for c in list(comms)))
        _HEALTH[id(store)] = health
        atexit.register(health.stop)
    if not health.running:
        health.start()
    _HEALTH_COMMS.add(comm)
    comm.health = health
    return health


def detach_health(comm: Comm) -> None:
    """Undo :func:`attach_health` for ``comm`` (its session closed): the process's health record
    stops (heartbeat thread joined, ``sys.excepthook`` restored) once no communicator uses it."""
    health, comm.health = comm.health, None
    _HEALTH_COMMS.discard(comm)
    if health is None or any(c.health is health for c in list(_HEALTH_COMMS)):
        return
    health.stop()
    for key in [k for k, h in _HEALTH.items() if h is health]:
        del _HEALTH[key]


def process_health() -> RankHealth | None:
    """This process's health record (:func:`attach_health`), if one was started."""
    return next(iter(_HEALTH.values()), None)


_PEER_FAILURE_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Timed out",
                         "timed out", "Broken pipe", "NCCL communicator was aborted", "DistNetworkError")


def is_peer_failure(e: BaseException) -> bool:
    """Whether a collective's exception means another rank died, raised or hung (not bad input)."""
    return isinstance(e, dist.DistError) or any(m in str(e) for m in _PEER_FAILURE_MARKERS)


def peer_failure(comm: Comm, cause: BaseException, during: str | None = None) -> AutoTPError:
    """The :class:`~autotp.health.RankFailure` for a collective of ``comm`` that failed with
    ``cause``: with a health record, it names the rank(s) that failed and their last phase."""
    during = during or comm.during or "running a collective"
    if comm.health is not None:
        return comm.health.failure(during, cause)
    return rank_failure(comm.rank, comm.world_size, during, cause, [])


@contextlib.contextmanager
def _guard(comm: Comm, what: str) -> Iterator[None]:
    """Count one collective entered; turn a peer's failure into a RankFailure that names it."""
    comm.issued += 1
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, AutoTPError) or _is_unsupported(e) or not is_peer_failure(e):
            raise
        raise peer_failure(comm, e) from e


@contextlib.contextmanager
def peer_failures(comm: Comm, during: str) -> Iterator[None]:
    """For the block, failure messages say the rank was ``during`` (e.g. "the model was loading";
    an enclosing block's wins); a peer failure raised by torch.distributed outside the guarded
    collectives becomes a RankFailure too."""
    before = comm.during
    comm.during = during = before or during
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, AutoTPError) or comm.world_size == 1 or not is_peer_failure(e):
            raise
        raise peer_failure(comm, e, during) from e
    finally:
        comm.during = before


#: a shared-memory wait spins (yielding) this many times, about a millisecond, then sleeps
SPIN_SLEEP_AFTER = 4096
SPIN_SLEEP_S = 50e-6

#: C11 ``memory_order_seq_cst`` (GCC's ``__ATOMIC_SEQ_CST``)
_SEQ_CST = 5


def memory_fence() -> Any:
    """A full memory fence, ``atomic_thread_fence(memory_order_seq_cst)``, from the C runtime's
    libatomic (``mfence`` / a locked instruction on x86-64, which also drains non-temporal stores;
    ``dmb ish`` on ARM), as a Python callable; None where libatomic is missing. The shared-memory
    transport publishes through it, so its correctness rests on the fence, not on a CPU's store
    order or on how large a copy glibc makes non-temporal."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("atomic")
    if name is None:
        return None
    try:
        fence = ctypes.CDLL(name).atomic_thread_fence
    except (OSError, AttributeError):
        return None
    fence.argtypes, fence.restype = [ctypes.c_int], None
    return lambda: fence(_SEQ_CST)


class SharedMemoryCollectives:
    """All-reduce and small all-gathers for CPU ranks on one host through a shared-memory segment.

    Why: a decode step all-reduces one token's hidden state (a few KB) twice per block, and gloo
    pays ~0.1-1 ms of TCP loopback per call on a CPU host: measured on the 154M Llama at tp=2 on 2
    cores, gloo decodes at 85 ms/token and this at 45 (``benchmarks/generation.py``). DeepSpeed's CPU inference does the
    same (a shared-memory all-reduce). Larger all-reduces (a prefill's) go piece by piece, one
    slot per call; all-gathers larger than a slot stay with the process group.

    Layout: ``flags`` (int64 per rank: the last call number that rank has published) and two
    buffers x ``world_size`` slots x ``capacity`` bytes. Call ``k`` on rank ``r``: copy the input
    into slot ``r`` of buffer ``k % 2``, store ``flags[r] = k``, wait until every flag is >= ``k``,
    then reduce the slots in rank order 0..N-1 (every rank computes the same bits, as a replicated
    value must be). Reuse: buffer ``k % 2`` is next written by call ``k + 2``, which a rank starts
    only after waiting in call ``k + 1`` for every flag >= ``k + 1``, i.e. after every rank has
    finished reading call ``k``. Ordering: the slot's bytes must be visible before the flag, and
    a reader must not read a slot before it has seen the flag. A full fence
    (:func:`memory_fence`, libatomic's ``atomic_thread_fence(seq_cst)``) sits between the copy and
    the flag store, and another between seeing the flags and reading the slots, so this holds
    whatever the copy does (glibc switches to non-temporal, weakly ordered stores above a
    cache-dependent size) and on any CPU, not only by x86-64's store order. Waiting ranks spin (yielding the core when there are
    more ranks than cores), then sleep 50 us at a time once a wait has lasted about a millisecond
    (a peer still computing should get the core). A rank that failed or died (by the rank-health
    records), or that does not arrive within ``timeout_s``, makes them raise a
    :class:`~autotp.health.RankFailure` naming it.

    The segment is a file in ``/dev/shm`` created by rank 0, mapped by every rank and unlinked as
    soon as all have mapped it, so nothing is left behind whatever happens to the processes.
    """

    def __init__(self, comm: Comm, capacity: int, timeout_s: float, folder: str = "/dev/shm") -> None:
        import numpy as np  # transformers' dependency; torch itself does not need it

        self.rank, self.world_size, self.capacity, self.timeout_s = comm.rank, comm.world_size, capacity, timeout_s
        self.comm = comm  # its health record names a rank that died while the others wait
        flags_bytes = 64 * self.world_size  # one cache line per rank's flag
        size = flags_bytes + 2 * self.world_size * capacity
        path = broadcast_object(os.path.join(folder, f"autotp-{uuid.uuid4().hex}") if comm.rank == 0 else None, comm)
        if comm.rank == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        barrier(comm)  # the file exists
        if comm.rank != 0:
            fd = os.open(path, os.O_RDWR)
        self.mapping = mmap.mmap(fd, size)
        os.close(fd)
        barrier(comm)  # every rank has mapped it
        if comm.rank == 0:
            os.unlink(path)  # the mapping lives on until every rank exits; nothing is left behind
        self.flags = np.ndarray((self.world_size, 8), dtype=np.int64, buffer=self.mapping)[:, 0]
        self.data = torch.frombuffer(self.mapping, dtype=torch.uint8, offset=flags_bytes,
                                     count=2 * self.world_size * capacity).view(2, self.world_size, capacity)
        self.calls = 0  # the file starts zeroed: every flag is 0
        fence = memory_fence()
        if fence is None:
            raise AutoTPError("the shared-memory transport needs libatomic's memory fence, which this host lacks")
        self.fence = fence

    def fits(self, x: Tensor) -> bool:
        """Whether :meth:`all_gather` takes ``x`` (a CPU tensor within one slot);
        :meth:`all_reduce` takes any CPU tensor, in slot-sized pieces."""
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.capacity

    def _publish(self, x: Tensor) -> int:
        """Copy ``x`` (flat, at most one slot) into this rank's slot of the next call's buffer and
        wait for every rank's; returns the buffer index. Release: a full fence between the copy
        (and this rank's reads of the previous calls) and the flag; acquire: a full fence between
        seeing every flag and reading the slots."""
        self.calls += 1
        call, buffer = self.calls, self.calls % 2
        nbytes = x.numel() * x.element_size()
        self.data[buffer, self.rank, :nbytes].view(x.dtype).copy_(x)
        self.fence()  # the slot's bytes (however the copy stored them) are visible before the flag
        self.flags[self.rank] = call
        self._wait_for(call)
        self.fence()  # no read of a peer's slot moves before its flag was seen
        return buffer

    def _slot(self, buffer: int, rank: int, like: Tensor) -> Tensor:
        nbytes = like.numel() * like.element_size()
        return self.data[buffer, rank, :nbytes].view(like.dtype)

    def _wait_for(self, call: int) -> None:
        """Spin until every rank has published ``call``; every half second, ask the rank-health
        records (:mod:`autotp.health`) whether a rank failed or died, and give up after
        ``timeout_s`` naming the ranks that never arrived."""
        flags = self.flags
        if int(flags.min()) >= call:
            return
        start = time.monotonic()
        next_check, spins = start + 0.5, 0
        while int(flags.min()) < call:
            spins += 1
            if spins > SPIN_SLEEP_AFTER:
                time.sleep(SPIN_SLEEP_S)  # a long wait (a peer still computing): free the core
            elif spins > 64:
                os.sched_yield()  # more ranks than cores: let the others run
            if spins % 1024 == 0 and time.monotonic() > next_check:
                next_check = time.monotonic() + 0.5
                self._check_peers(call, timed_out=next_check - 0.5 - start > self.timeout_s)

    def _check_peers(self, call: int, timed_out: bool) -> None:
        late = [q for q in range(self.world_size) if int(self.flags[q]) < call]
        cause = f"shared-memory all-reduce #{call} waited for rank(s) {late}"
        health = self.comm.health
        during = self.comm.during or "a collective was running"
        suspects = [s for s in health.diagnose(stale_after=0) if s.kind in ("failed", "dead")] if health else []
        if suspects:
            raise rank_failure(self.rank, self.world_size, during, cause, suspects)
        if timed_out:
            raise rank_failure(self.rank, self.world_size, during, f"{cause} for {self.timeout_s:.0f} s",
                               health.diagnose() if health else [])

    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        """Sum (or maximum) of a CPU tensor over the ranks, out of place, one slot-sized piece
        per call (see the class docstring)."""
        out = x.clone(memory_format=torch.contiguous_format)
        flat = out.view(-1)  # (numel,)
        step = max(self.capacity // x.element_size(), 1)
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            buffer = self._publish(piece)
            piece.copy_(self._slot(buffer, 0, piece))
            for q in range(1, self.world_size):  # slot 0 + slot 1 + ...: the same bits on every rank
                if op == "max":
                    torch.maximum(piece, self._slot(buffer, q, piece), out=piece)
                else:
                    piece.add_(self._slot(buffer, q, piece))
        return out

    def all_gather(self, x: Tensor) -> Tensor:
        """Every rank's ``x`` (a CPU tensor within one slot) stacked in rank order: ``(N, *x.shape)``."""
        buffer = self._publish(x.contiguous().view(-1))
        out = x.new_empty((self.world_size, *x.shape))  # (N, *local)
        for q in range(self.world_size):
            out[q].view(-1).copy_(self._slot(buffer, q, x))
        return out


# --------------------------------------------------------------------------------------------------
# Raw collectives along a tensor dim (no autograd). Each counts once under its logical kind.
# --------------------------------------------------------------------------------------------------


def _is_unsupported(err: RuntimeError) -> bool:
    msg = str(err).lower()
    return "not supported" in msg or "unsupported" in msg or "does not support" in msg


def _check_even(x: Tensor, dim: int, n: int, what: str) -> int:
    if dim >= x.dim():
        raise AutoTPError(f"{what}: Shard({dim}) of a {x.dim()}-d tensor of shape {tuple(x.shape)}")
    size = x.shape[dim]
    if size % n:
        raise ShardingError(
            f"{what}: dim {dim} of shape {tuple(x.shape)} has size {size}, not divisible by the "
            f"world size {n}; shard another dim or pick a world size that divides {size}"
        )
    return size // n


def _all_reduce(x: Tensor, comm: Comm, backward: bool, op: str = "sum") -> Tensor:
    """Sum (or maximum) over ranks (out of place)."""
    comm._record("all_reduce", x, backward)
    shm = comm.shared_memory
    if shm is not None and x.device.type == "cpu":
        comm.issued += 1
        return shm.all_reduce(x, op)
    out = x.clone(memory_format=torch.contiguous_format)
    if not comm.simulated:
        with _guard(comm, "all_reduce"):
            dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=comm.group)
    return out


#: the tensor forms of all-gather and reduce-scatter: torch 2.13 names them ``all_gather_single`` /
#: ``reduce_scatter_single`` and deprecates the older ``all_gather_into_tensor`` /
#: ``reduce_scatter_tensor``, the only names torch 2.11 (the CUDA image the GPU tests ran on) has
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_raw(x: Tensor, comm: Comm) -> Tensor:
    """All-gather ``x`` (contiguous) into a new ``(N, *x.shape)`` tensor."""
    n = comm.world_size
    out = x.new_empty((n, *x.shape))  # (N, *local)
    if comm.simulated:
        return out.copy_(x.expand(n, *x.shape))
    shm = comm.shared_memory
    if shm is not None and shm.fits(x):
        comm.issued += 1
        return shm.all_gather(x)
    if "all_gather" not in comm.emulate:
        try:
            # gloo accepts only the concatenated output form (N*d0, ...), a view of ``out``
            with _guard(comm, "all_gather"):
                _ALL_GATHER_SINGLE(out.flatten(0, 1) if x.dim() else out, x, group=comm.group)
            return out
        except RuntimeError as err:
            if not _is_unsupported(err):
                raise
            comm.emulate.add("all_gather")
    with _guard(comm, "all_gather"):
        dist.all_gather(list(out.unbind(0)), x, group=comm.group)
    return out


def _pad_to(x: Tensor, dim: int, length: int) -> Tensor:
    """``x`` with zeros appended along ``dim`` up to ``length`` (``x`` itself when long enough)."""
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    return torch.cat([x, x.new_zeros((*x.shape[:dim], missing, *x.shape[dim + 1 :]))], dim)


def _all_gather(x: Tensor, dim: int, comm: Comm, backward: bool, size: int | None = None) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order. ``size`` is the global size of
    ``dim`` when the chunks may be uneven: each rank's chunk is padded to ``ceil(size / N)``, and
    the padding (all at the tail, since only trailing chunks are short) is trimmed after."""
    if dim >= x.dim():
        raise AutoTPError(f"all_gather along dim {dim} of a {x.dim()}-d tensor")
    n = comm.world_size
    padded = size is not None and size % n != 0
    if padded:
        x = _pad_to(x, dim, -(-size // n))  # (..., ceil(size/N), ...)
    comm._record("all_gather", x, backward)
    stacked = _gather_raw(x.contiguous(), comm)  # (N, *local)
    # (N, ..., s_d, ...) -> (..., N, s_d, ...) -> (..., N*s_d, ...): rank r's rows land at r*s_d.
    moved = stacked.movedim(0, dim)
    out = moved.reshape(*x.shape[:dim], -1, *x.shape[dim + 1 :])
    return (out.narrow(dim, 0, size) if padded else out).contiguous()


def regather(x: Tensor, dim: int, comm: Comm) -> Tensor:
    """The all-gather along ``dim`` a backward repeats (not differentiable, counted as backward):
    sequence parallelism saves a column-parallel matmul's input as this rank's shard and gathers it
    again for the weight gradient (:class:`autotp.layers.LinearOnGatheredInput`)."""
    return _all_gather(x, dim, comm, backward=True)


def _own_chunk(x: Tensor, dim: int, comm: Comm, what: str) -> Tensor:
    """This rank's chunk of ``x`` along ``dim`` (``torch.chunk`` semantics, uneven allowed), contiguous."""
    if dim >= x.dim():
        raise AutoTPError(f"{what}: Shard({dim}) of a {x.dim()}-d tensor of shape {tuple(x.shape)}")
    start, stop = chunk_range(x.shape[dim], comm.rank, comm.world_size)
    return x.narrow(dim, start, stop - start).contiguous()


def _reduce_scatter(x: Tensor, dim: int, comm: Comm, backward: bool) -> Tensor:
    """Sum over ranks, keep this rank's chunk along ``dim`` (an uneven dim is padded to ``N`` equal
    blocks first and this rank's block trimmed to its chunk)."""
    n = comm.world_size
    if dim < x.dim() and x.shape[dim] % n:
        size = x.shape[dim]
        out = _reduce_scatter(_pad_to(x, dim, n * -(-size // n)), dim, comm, backward)
        start, stop = chunk_range(size, comm.rank, n)
        return out.narrow(dim, 0, stop - start).contiguous()
    s = _check_even(x, dim, n, "reduce_scatter")
    comm._record("reduce_scatter", x, backward)
    if comm.simulated:
        return x.narrow(dim, comm.rank * s, s).contiguous()
    if "reduce_scatter" not in comm.emulate:
        # (..., D, ...) -> (..., N, D/N, ...) -> (N, ..., D/N, ...): chunk r is block r.
        inp = x.unflatten(dim, (n, s)).movedim(dim, 0).contiguous()
        out = x.new_empty(inp.shape[1:])  # (..., D/N, ...)
        try:
            # concatenated input form (N*d0, ...), which every backend accepts
            with _guard(comm, "reduce_scatter"):
                _REDUCE_SCATTER_SINGLE(out, inp.flatten(0, 1), group=comm.group)
            return out
        except RuntimeError as err:
            if not _is_unsupported(err):
                raise
            comm.emulate.add("reduce_scatter")
    full = x.clone(memory_format=torch.contiguous_format)
    with _guard(comm, "all_reduce"):
        dist.all_reduce(full, group=comm.group)
    return full.narrow(dim, comm.rank * s, s).contiguous()


def _all_to_all(x: Tensor, gather_dim: int, scatter_dim: int, comm: Comm, backward: bool) -> Tensor:
    """``S(gather_dim) -> S(scatter_dim)``: split ``x`` along ``scatter_dim``, send chunk j to rank j,
    concatenate what arrives along ``gather_dim`` in rank order."""
    n = comm.world_size
    s = _check_even(x, scatter_dim, n, "all_to_all")
    if gather_dim >= x.dim():
        raise AutoTPError(f"all_to_all gathering dim {gather_dim} of a {x.dim()}-d tensor")
    comm._record("all_to_all", x, backward)
    if "all_to_all" not in comm.emulate and not comm.simulated:
        # (..., B, ...) -> (..., N, B/N, ...) -> (N, ..., B/N, ...): block j goes to rank j.
        inp = x.unflatten(scatter_dim, (n, s)).movedim(scatter_dim, 0).contiguous()
        out = torch.empty_like(inp)  # (N, ..., B/N, ...): block i came from rank i
        try:
            with _guard(comm, "all_to_all"):
                dist.all_to_all_single(out, inp, group=comm.group)
            # (N, ..., A/N, ...) -> (..., N, A/N, ...) -> (..., A, ...)
            moved = out.movedim(0, gather_dim)
            shape = inp.shape[1:]
            return moved.reshape(*shape[:gather_dim], -1, *shape[gather_dim + 1 :]).contiguous()
        except RuntimeError as err:
            if not _is_unsupported(err):
                raise
            comm.emulate.add("all_to_all")
    # Emulation: gather everything along gather_dim (N times the bytes), keep own chunk.
    stacked = _gather_raw(x.contiguous(), comm)  # (N, *local)
    full = stacked.movedim(0, gather_dim).reshape(*x.shape[:gather_dim], -1, *x.shape[gather_dim + 1 :])
    return full.narrow(scatter_dim, comm.rank * s, s).contiguous()


# --------------------------------------------------------------------------------------------------
# Differentiable redistributions: forward/backward conjugate pairs.
# --------------------------------------------------------------------------------------------------


class CopyToParallelRegion(torch.autograd.Function):
    """``R -> R`` feeding a sharded/partial consumer: forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.comm, backward=True), None


class ReduceFromParallelRegion(torch.autograd.Function):
    """``P -> R``: forward all-reduce (sum); backward identity, or all-reduce if the grad is partial."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm, grad_partial: bool) -> Tensor:
        ctx.comm, ctx.grad_partial = comm, grad_partial
        return _all_reduce(x, comm, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        if ctx.grad_partial:
            return _all_reduce(grad, ctx.comm, backward=True), None, None
        return grad, None, None


class ScatterToParallelRegion(torch.autograd.Function):
    """``R -> S(d)``: forward keep own chunk along ``d``; backward all-gather along ``d``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, comm: Comm) -> Tensor:
        ctx.comm, ctx.dim, ctx.size = comm, dim, x.shape[dim]
        return _own_chunk(x, dim, comm, "R -> S")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.comm, backward=True, size=ctx.size), None, None


class GatherFromParallelRegion(torch.autograd.Function):
    """``S(d) -> R``: forward all-gather along ``d``; backward own chunk, or reduce-scatter along
    ``d`` if the grad is partial."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, comm: Comm, grad_partial: bool, size: int | None) -> Tensor:
        ctx.comm, ctx.dim, ctx.grad_partial = comm, dim, grad_partial
        return _all_gather(x, dim, comm, backward=False, size=size)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        if ctx.grad_partial:
            return _reduce_scatter(grad, ctx.dim, ctx.comm, backward=True), None, None, None, None
        return _own_chunk(grad, ctx.dim, ctx.comm, "S -> R backward"), None, None, None, None


class ReduceScatterToParallelRegion(torch.autograd.Function):
    """``P -> S(d)``: forward reduce-scatter along ``d``; backward all-gather along ``d``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, comm: Comm) -> Tensor:
        ctx.comm, ctx.dim, ctx.size = comm, dim, x.shape[dim]
        return _reduce_scatter(x, dim, comm, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.comm, backward=True, size=ctx.size), None, None


class AllToAllParallelRegion(torch.autograd.Function):
    """``S(a) -> S(b)``: forward all-to-all (gather ``a``, scatter ``b``); backward the reverse."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, src_dim: int, dst_dim: int, comm: Comm) -> Tensor:
        ctx.comm, ctx.src_dim, ctx.dst_dim = comm, src_dim, dst_dim
        return _all_to_all(x, src_dim, dst_dim, comm, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _all_to_all(grad, ctx.dst_dim, ctx.src_dim, ctx.comm, backward=True), None, None, None


class GroupedRedistribute(torch.autograd.Function):
    """To, from or out of a :class:`~autotp.placement.GroupedShard`: ``R -> S(d/g)`` and
    ``S(d/g) -> S(d)`` narrow locally, ``S(d/g) -> R`` all-gathers over every rank and keeps one
    chunk per group. Forward only: a gradient through it is refused (the solver offers grouped
    placements in inference graphs only)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, src: Placement, dst: Placement, comm: Comm) -> Tensor:
        ctx.src, ctx.dst = src, dst
        if isinstance(src, GroupedShard) and isinstance(dst, Replicate):
            gathered = _all_gather(x, src.dim, comm, backward=False)
            return _one_chunk_per_group(gathered, src, comm.world_size)
        return _grouped_narrow(x, src, dst, comm)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, None]:
        raise _grouped_gradient_error()


class ReduceOverChunkGroup(torch.autograd.Function):
    """Identity on a parameter held per group of ranks (``GroupedShard``: a k/v projection whose kv
    heads the ranks outnumber); its backward sums the gradient over the ranks of this rank's group
    (:func:`chunk_group`). Each of them uses its own query heads' share of the kv head, so each
    holds a partial gradient of the same rows; the sum is the gradient one process computes. (The
    gradient into the projection's input is a partial sum over all ranks, reduced by the
    all-reduce-backward edge every replicated input of a non-replicated node gets.) The rewrite
    puts it on such a parameter's use in every graph that may train.

    ``rows``: only these ``[start, stop)`` ranges along ``dim`` are summed, the rest of the gradient
    is this rank's own: a fused q|k|v projection whose k and v heads are held per group of ranks
    beside its split q heads (``StridedShard.groups``, Phi-3's ``qkv_proj``), where the group's
    ranks hold those rows alike and each its own q rows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm, groups: int, dim: int = 0,
                rows: tuple[tuple[int, int], ...] | None = None) -> Tensor:
        ctx.comm, ctx.groups, ctx.dim, ctx.rows = comm, groups, dim, rows
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        comm = ctx.comm

        def over_group(t: Tensor) -> Tensor:  # in place, over this rank's group
            comm._record("all_reduce", t, backward=True)
            if not comm.simulated:
                with _guard(comm, "all_reduce"):
                    dist.all_reduce(t, group=chunk_group(comm, ctx.groups))
            return t

        out = grad.clone(memory_format=torch.contiguous_format)
        out = over_group(out) if ctx.rows is None else _sum_rows(out, ctx.dim, ctx.rows, over_group)
        return out, None, None, None, None


def reduce_over_chunk_group(x: Tensor, comm: Comm, groups: int, dim: int = 0,
                            rows: tuple[tuple[int, int], ...] | None = None) -> Tensor:
    """:class:`ReduceOverChunkGroup` (a plain function, for an FX ``call_function`` node)."""
    return ReduceOverChunkGroup.apply(x, comm, groups, dim, rows)


def chunk_group(comm: Comm, groups: int) -> dist.ProcessGroup | None:
    """The process group of the ``N / groups`` consecutive ranks of ``comm`` that hold this rank's
    chunk of a ``GroupedShard`` with ``groups`` chunks; None for a simulated group. Collective on
    first use for a count: every process of the default group makes every such group (torch's
    ``new_subgroups_by_enumeration``), so under a dp x tp mesh the tp groups' ranks are gathered
    first. The shared-memory transport has no subgroups, so these all-reduces go through the
    process group's backend."""
    if comm.simulated or comm.group is None:
        return None
    if groups not in comm.chunk_groups:
        ranks = dist.get_process_group_ranks(comm.group)  # global ranks, in tp order
        every = [ranks]
        if dist.get_world_size() != comm.world_size:  # several tp groups (a dp x tp mesh)
            every = [None] * dist.get_world_size()
            with _guard(comm, "all_gather_object"):
                dist.all_gather_object(every, ranks)
        size = comm.world_size // groups
        enumeration = [list(tp[g * size:(g + 1) * size]) for tp in dict.fromkeys(map(tuple, every))
                       for g in range(groups)]
        with _guard(comm, "new_group"):
            mine, _ = dist.new_subgroups_by_enumeration(enumeration, backend=dist.get_backend(comm.group))
        comm.chunk_groups[groups] = mine
    return comm.chunk_groups[groups]


class RefuseGradient(torch.autograd.Function):
    """Identity on a parameter whose layout autotp cannot train through yet; its backward raises
    the ``AutoTPError`` its maker gives. The rewrite puts it on such a parameter's use in every
    graph that may train, so a wrong gradient never passes silently: a parameter with segments every
    rank holds whole (``StridedShard.whole``) read by a node whose output does not keep them whole
    (where :class:`WholeSegmentBackward` cannot go)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, error: Callable[[], AutoTPError]) -> Tensor:
        ctx.error = error
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> None:
        raise ctx.error()


def _grouped_gradient_error() -> AutoTPError:
    return AutoTPError(
        "a gradient through a gather or narrowing of key/value heads held per group of ranks (tp_size exceeds "
        "the model's kv heads) is not supported: train with tp_size at most the number of kv heads, or load "
        "with parallelize_model(..., warmup=False) so that the first, training call places them")


def _whole_segment_gradient_error() -> AutoTPError:
    return AutoTPError(
        "training through a fused projection whose key/value heads every rank holds whole beside its split "
        "query heads, read by an operation other than the projection, is not supported: its input gradient "
        "would count those heads once per rank. Load with parallelize_model(..., warmup=False) so that the "
        "first, training call places it")


def refuse_gradient(x: Tensor) -> Tensor:
    """:class:`RefuseGradient` for a parameter stored with whole segments (a plain function, for an
    FX ``call_function`` node); see :func:`refuses_gradient`."""
    return RefuseGradient.apply(x, _whole_segment_gradient_error)


def refuses_gradient(placement: Placement | None) -> bool:
    """Whether a parameter stored at ``placement`` may be bound through :func:`refuse_gradient` in a
    graph that may train (see :class:`RefuseGradient`): segments every rank holds whole (which
    train where the projection alone reads them, ``autotp/passes/rewrite.py``). Segments held per
    group of ranks alone train through :class:`ReduceOverChunkGroup` over their rows."""
    return isinstance(placement, StridedShard) and bool(placement.whole)


class WholeSegmentBackward(torch.autograd.Function):
    """Identity forward on segments every rank holds whole (``StridedShard.whole``: Falcon's one k
    and v head beside its split q heads); backward, one of two halves of their gradient:

    * ``owner=True``, on the fused projection's output: ranks other than 0 drop the whole segments'
      gradient. Those segments are replicated values, so their gradient arrives whole on every rank
      (the module invariant: an ``R`` gradient is the full logical one), while the projection's
      input gradient is a partial sum over ranks (its split segments): without this the sum would
      count the whole segments' share ``N`` times. Kept on rank 0 only, it counts once.
    * ``owner=False``, on the parameter: one all-reduce of the whole segments' rows of its gradient,
      which the owner left on rank 0 alone, so every rank holds the same gradient of the rows it
      holds alike (and an optimizer step keeps them equal)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, placement: StridedShard, comm: Comm, owner: bool) -> Tensor:
        ctx.placement, ctx.comm, ctx.owner = placement, comm, owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        d, comm = ctx.placement.dim, ctx.comm
        if ctx.owner and comm.rank == 0:
            return grad, None, None, None
        rows = ctx.placement.whole_local_bounds(comm.world_size, comm.rank)
        out = grad.clone(memory_format=torch.contiguous_format)
        if ctx.owner:
            for a, b in rows:
                out.narrow(d, a, b - a).zero_()
            return out, None, None, None
        return _sum_rows(out, d, rows, lambda t: _all_reduce(t, comm, backward=True)), None, None, None


def _sum_rows(out: Tensor, dim: int, rows: Sequence[tuple[int, int]], reduce: Callable[[Tensor], Tensor]) -> Tensor:
    """``out`` with its ``[start, stop)`` ranges ``rows`` along ``dim`` replaced, in place, by their
    sum over ranks: one collective (``reduce``) over the rows concatenated."""
    summed = reduce(torch.cat([out.narrow(dim, a, b - a) for a, b in rows], dim))
    offset = 0
    for a, b in rows:
        out.narrow(dim, a, b - a).copy_(summed.narrow(dim, offset, b - a))
        offset += b - a
    return out


def whole_segment_backward(x: Tensor, placement: StridedShard, comm: Comm, owner: bool) -> Tensor:
    """:class:`WholeSegmentBackward` (a plain function, for an FX ``call_function`` node)."""
    return WholeSegmentBackward.apply(x, placement, comm, owner)


def _one_chunk_per_group(gathered: Tensor, src: GroupedShard, world_size: int) -> Tensor:
    """Every rank's chunk along ``src.dim`` (N chunks, each group's repeated N/groups times) ->
    the whole tensor: the first rank of each group's chunk."""
    d = src.dim
    if src.inner is not None:  # (.., N, c, ..): rank q holds kv head q // (N/groups), copies chunk q % (N/groups)
        return gathered.unflatten(d, (src.groups, world_size // src.groups)).flatten(d + 1, d + 2).contiguous()
    per_rank = gathered.shape[d] // world_size
    # (..., N*c, ...) -> (..., groups, N/groups, c, ...): keep replica 0 of each group
    split = gathered.unflatten(d, (src.groups, world_size // src.groups, per_rank))
    return split.select(d + 1, 0).flatten(d, d + 1).contiguous()


def _grouped_narrow(x: Tensor, src: Placement, dst: Placement, comm: Comm) -> Tensor:
    """The local narrows: ``R -> S(d/g)`` keeps the group's chunk, ``S(d/g) -> S(d)`` this rank's
    chunk inside its group's."""
    n, r = comm.world_size, comm.rank
    if isinstance(src, Replicate) and isinstance(dst, GroupedShard):
        s = _check_even(x, dst.dim, dst.groups, "R -> grouped shard")
        return x.narrow(dst.dim, dst.group(r, n) * s, s).contiguous()
    if isinstance(src, GroupedShard) and type(dst) is Shard and dst.dim == src.dim:
        per_group = n // src.groups
        s = _check_even(x, dst.dim, per_group, "grouped shard -> shard")
        return x.narrow(dst.dim, (r % per_group) * s, s).contiguous()
    raise _unsupported(src, dst)


class HeadRedistribute(torch.autograd.Function):
    """Out of or into a :class:`~autotp.placement.HeadShard`: ``S(d:Hh) -> R`` all-gathers the
    ranks' heads (:func:`_gather_heads`), ``R -> S(d:Hh)`` narrows to this rank's heads. Backward,
    the conjugates as for a plain shard: the narrow's gradient is the heads gathered again; the
    gather's is this rank's heads of the (replicated) gradient, or, with ``grad_partial`` (a
    partial-sum gradient arrives, e.g. from a column-parallel matmul), of its all-reduce: the
    ranks' blocks are uneven, so a reduce-scatter would pad every block to the longest; the
    all-reduce moves ``2(N-1)/N`` of the gradient against its ``(N-1)/N`` (priced as such by
    :func:`backward_kind_of`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, src: Placement, dst: Placement, comm: Comm, grad_partial: bool = False
                ) -> Tensor:
        ctx.src, ctx.dst, ctx.comm, ctx.grad_partial = src, dst, comm, grad_partial
        if isinstance(src, HeadShard):
            return _gather_heads(x, src, comm.rank, comm.world_size,
                                 lambda t: _all_gather(t, src.dim, comm, backward=False))
        return _own_heads(x, dst, comm)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        comm = ctx.comm
        if isinstance(ctx.src, HeadShard):  # S(d:Hh) -> R: this rank's heads of the whole gradient
            whole = _all_reduce(grad, comm, backward=True) if ctx.grad_partial else grad
            return _own_heads(whole, ctx.src, comm), None, None, None, None
        gathered = _gather_heads(grad, ctx.dst, comm.rank, comm.world_size,  # R -> S(d:Hh): every rank's heads
                                 lambda t: _all_gather(t, ctx.dst.dim, comm, backward=True))
        return gathered, None, None, None, None


def _own_heads(x: Tensor, placement: HeadShard, comm: Comm) -> Tensor:
    """This rank's heads of the whole ``x`` along ``placement.dim``, contiguous."""
    start, stop = placement.index_range(x.shape[placement.dim], comm.rank, comm.world_size)
    return x.narrow(placement.dim, start, stop - start).contiguous()


def _gather_heads(x: Tensor, src: HeadShard, rank: int, world_size: int, gather: Callable[[Tensor], Tensor]
                  ) -> Tensor:
    """The whole dim from every rank's heads: each rank's block padded to the longest (``gather``
    concatenates the padded blocks in rank order along ``src.dim``), then each rank's valid part
    kept. A head's width is this rank's block over its head count (every rank holds one or more)."""
    d = src.dim
    start, stop = src.head_range(rank, world_size)
    unit = x.shape[d] // (stop - start)
    widths = [n * unit for n in src.heads_per_rank(world_size)]
    longest = max(widths)
    gathered = gather(_pad_to(x, d, longest).contiguous())  # (.., N * longest, ..)
    return torch.cat([gathered.narrow(d, r * longest, w) for r, w in enumerate(widths)], d)


def _unsupported(src: Placement, dst: Placement) -> AutoTPError:
    if isinstance(src, GroupedShard) or isinstance(dst, GroupedShard):
        return AutoTPError(f"redistribution {src} -> {dst} is not supported: a grouped shard comes from R "
                           "by a narrow and goes to R or to a plain shard of its dim")
    return AutoTPError(
        f"redistribution {src} -> {dst} is not supported: a Partial value cannot be produced by "
        "communication (it is the output of a local op such as a row-parallel matmul); plan the "
        "producer to emit P, or choose R or S(d) as the destination"
    )


def is_supported(src: Placement, dst: Placement) -> bool:
    """Whether :func:`redistribute` can turn ``src`` into ``dst`` (everything except ``R/S -> P``;
    a grouped shard only from ``R`` or itself, and only to itself, ``R`` or ``Shard`` of its dim)."""
    if isinstance(src, GroupedShard) or isinstance(dst, GroupedShard):
        return _grouped_supported(src, dst)
    if isinstance(src, HeadShard) or isinstance(dst, HeadShard):  # kept, gathered, or narrowed from R
        return src == dst or isinstance(src, HeadShard) and isinstance(dst, Replicate) \
            or isinstance(src, Replicate) and isinstance(dst, HeadShard)
    return not (isinstance(dst, Partial) and not isinstance(src, Partial))


def _grouped_supported(src: Placement, dst: Placement) -> bool:
    if src == dst:
        return True
    if isinstance(src, GroupedShard):
        return isinstance(dst, Replicate) or (type(dst) is Shard and dst.dim == src.dim and src.inner is None)
    return isinstance(dst, GroupedShard) and dst.inner is None and isinstance(src, Replicate)


def kind_of(src: Placement, dst: Placement) -> str | None:
    """The forward collective of ``src -> dst`` (one of :data:`KINDS`), or None when it is local
    (identity or ``R -> S``). Raises :class:`AutoTPError` for unsupported pairs."""
    if not is_supported(src, dst):
        raise _unsupported(src, dst)
    if isinstance(src, (GroupedShard, HeadShard)):
        return "all_gather" if isinstance(dst, Replicate) else None
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return "all_reduce"
        if isinstance(dst, Shard):
            return "reduce_scatter"
        return None
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return "all_gather"
        if isinstance(dst, Shard) and dst.dim != src.dim:
            return "all_to_all"
    return None


def backward_kind_of(src: Placement, dst: Placement, grad_partial: bool = False) -> str | None:
    """The backward collective of ``src -> dst`` (see the module table), or None when local."""
    if not is_supported(src, dst):
        raise _unsupported(src, dst)
    if grad_partial and not isinstance(dst, Replicate):
        raise AutoTPError(f"grad_partial applies to a Replicate destination only, got {src} -> {dst}")
    if isinstance(src, GroupedShard) or isinstance(dst, GroupedShard):
        return None  # forward only (see the module table): their Functions refuse a gradient
    if isinstance(dst, HeadShard):
        return "all_gather"
    if isinstance(src, HeadShard):
        return "all_reduce" if grad_partial else None
    if isinstance(dst, Replicate):
        if not grad_partial:
            return None
        return "reduce_scatter" if isinstance(src, Shard) else "all_reduce"
    if isinstance(dst, Shard):
        if isinstance(src, (Replicate, Partial)):
            return "all_gather"
        if isinstance(src, Shard) and src.dim != dst.dim:
            return "all_to_all"
    return None


def cost_bytes(src: Placement, dst: Placement, nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in the forward of ``src -> dst`` under the ring model.

    ``nbytes`` is the size of the *full logical* tensor (global shape). With ``N = world_size``:

    * all-reduce: ``2 (N-1)/N * nbytes`` (reduce-scatter then all-gather, each ``(N-1)/N``);
    * all-gather: ``(N-1)/N * nbytes`` (each rank forwards ``N-1`` chunks of ``nbytes/N``);
    * reduce-scatter: ``(N-1)/N * nbytes`` (the mirror image of all-gather);
    * all-to-all: ``(N-1)/N**2 * nbytes`` (each rank holds ``nbytes/N`` and keeps ``1/N`` of it);
    * ``R -> S``, identities and world size 1: ``0``;
    * unsupported pairs (``R -> P``, ``S -> P``): ``inf``, so a solver never picks them.
    """
    if not is_supported(src, dst):
        return float("inf")
    n = world_size
    if n <= 1:
        return 0.0
    kind = kind_of(src, dst)
    if isinstance(src, GroupedShard) and kind == "all_gather":
        return (n - 1) / src.groups * nbytes  # every rank hands over its nbytes/groups
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes
    if kind == "all_to_all":
        return (n - 1) / (n * n) * nbytes
    return 0.0


# --------------------------------------------------------------------------------------------------
# Functional (traceable) redistributions, for an inner compiler such as inductor.
# --------------------------------------------------------------------------------------------------


def functional_redistribute(x: Tensor, src: Placement, dst: Placement, comm: Comm, size: int | None = None
                            ) -> Tensor:
    """:func:`redistribute` through ``torch.distributed._functional_collectives`` (out of place,
    then ``wait_tensor``), so Dynamo / inductor trace each collective as a graph op
    (``_c10d_functional.all_reduce`` ...) instead of an opaque in-place call. Forward only (the
    inner compiler gets inference graphs only), not counted in :class:`Comm` (the caller counts
    the plan's collectives per call), and never simulated.

    ``S(a) -> S(b)`` is an all-to-all over the concatenated layout, as in :func:`_all_to_all`.
    An uneven ``S(d) -> R`` (``size`` given, see :func:`redistribute`) is padded and trimmed as in
    :func:`_all_gather`.
    """
    from autotp.compat import functional_collectives

    funcol = functional_collectives()

    if not is_supported(src, dst):
        raise _unsupported(src, dst)
    if comm.world_size == 1 or src == dst:
        return x
    if comm.simulated or comm.group is None:
        raise AutoTPError("functional_redistribute needs a real process group (not a simulated one)")
    n, group = comm.world_size, comm.group
    if isinstance(src, GroupedShard) or isinstance(dst, GroupedShard):
        if isinstance(src, GroupedShard) and isinstance(dst, Replicate):
            gathered = funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), src.dim, group))
            return _one_chunk_per_group(gathered, src, n)
        return _grouped_narrow(x, src, dst, comm)
    if isinstance(src, HeadShard):
        return _gather_heads(x, src, comm.rank, n,
                             lambda t: funcol.wait_tensor(funcol.all_gather_tensor(t, src.dim, group)))
    if isinstance(dst, HeadShard):
        return HeadRedistribute.apply(x, src, dst, comm)
    if isinstance(src, Replicate):
        assert isinstance(dst, Shard)
        start, stop = chunk_range(x.shape[dst.dim], comm.rank, n)
        return x.narrow(dst.dim, start, stop - start)
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))
        assert isinstance(dst, Shard)
        _check_even(x, dst.dim, n, "reduce_scatter")
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(x.contiguous(), "sum", dst.dim, group))
    assert isinstance(src, Shard)
    if isinstance(dst, Replicate):
        if size is not None and size % n:
            padded = _pad_to(x, src.dim, -(-size // n)).contiguous()
            return funcol.wait_tensor(funcol.all_gather_tensor(padded, src.dim, group)).narrow(src.dim, 0, size)
        return funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), src.dim, group))
    assert isinstance(dst, Shard)
    s = _check_even(x, dst.dim, n, "all_to_all")
    # (..., B, ...) -> (N, ..., B/N, ...): block j goes to rank j
    inp = x.unflatten(dst.dim, (n, s)).movedim(dst.dim, 0).contiguous()
    out = funcol.wait_tensor(funcol.all_to_all_single(inp.flatten(0, 1), None, None, group))
    moved = out.unflatten(0, (n, inp.shape[1])).movedim(0, src.dim)  # (..., N, A/N, ...)
    shape = inp.shape[1:]
    return moved.reshape(*shape[: src.dim], -1, *shape[src.dim + 1 :])


def full_tensor(local: Tensor, placement: Placement, comm: Comm, size: int | None = None) -> Tensor:
    """The whole logical tensor, on every rank, from this rank's piece: ``redistribute(-> R)``, and
    for a fused layout (``StridedShard``: rank ``r`` holds chunk ``r`` of each segment) the gathered
    rank-major pieces put back in segment order. ``size`` as for :func:`redistribute`."""
    if not isinstance(placement, StridedShard):
        return redistribute(local, placement, R, comm, size=size)
    n, dim = comm.world_size, placement.dim
    longest = placement.local_length(n, 0)  # segments split in heads: ranks hold unequal lengths (rank 0 the most)
    padded = torch.nn.functional.pad(local.movedim(dim, -1), (0, longest - local.shape[dim])).movedim(-1, dim)
    gathered = redistribute(padded, Shard(dim), R, comm)  # (.., [seg_0 / N | seg_1 / N | ...] x N ranks, ..)
    per_rank = [chunk.narrow(dim, 0, placement.local_length(n, r)).split(placement.local_segments(n, r), dim)
                for r, chunk in enumerate(gathered.chunk(n, dim))]
    # a whole segment is the same on every rank: rank 0's copy
    return torch.cat([per_rank[r][s] for s in range(len(placement.segments))
                      for r in (range(1) if s in placement.whole else range(0, n, n // placement.groups[s])
                                if placement.groups and placement.groups[s] else range(n))], dim)


def redistribute(
    x: Tensor, src: Placement, dst: Placement, comm: Comm, grad_partial: bool = False, size: int | None = None
) -> Tensor:
    """Turn this rank's piece ``x`` of a logical tensor placed as ``src`` into its piece under ``dst``.

    Differentiable; see the module docstring for the forward/backward pairs. ``grad_partial=True``
    (``dst`` must be ``R``) says the gradient arriving at the output is a partial sum, so backward
    all-reduces it (``R -> R``, ``P -> R``) or reduce-scatters it (``S -> R``). At world size 1
    every supported pair returns ``x`` itself and nothing is counted. ``size`` is the global size of
    ``src``'s sharded dim; it is needed (and used) only where the ranks' chunks are uneven.
    """
    if not is_supported(src, dst):
        raise _unsupported(src, dst)
    if grad_partial and not isinstance(dst, Replicate):
        raise AutoTPError(
            f"grad_partial=True needs a Replicate destination, got {src} -> {dst}: only a replicated "
            "value can feed a consumer whose gradient comes back partial"
        )
    for p in (src, dst):
        if isinstance(p, Shard) and p.dim >= x.dim():
            raise AutoTPError(f"{src} -> {dst} on a {x.dim()}-d tensor of shape {tuple(x.shape)}")
    if comm.world_size == 1 or (src == dst and not grad_partial):
        return x
    if isinstance(src, GroupedShard) or isinstance(dst, GroupedShard):
        return GroupedRedistribute.apply(x, src, dst, comm)
    if isinstance(src, HeadShard) or isinstance(dst, HeadShard):
        return HeadRedistribute.apply(x, src, dst, comm, grad_partial)
    if isinstance(src, Replicate):
        if isinstance(dst, Replicate):
            return CopyToParallelRegion.apply(x, comm)
        assert isinstance(dst, Shard)
        return ScatterToParallelRegion.apply(x, dst.dim, comm)
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return ReduceFromParallelRegion.apply(x, comm, grad_partial)
        assert isinstance(dst, Shard)
        return ReduceScatterToParallelRegion.apply(x, dst.dim, comm)
    assert isinstance(src, Shard)
    if isinstance(dst, Replicate):
        return GatherFromParallelRegion.apply(x, src.dim, comm, grad_partial, size)
    assert isinstance(dst, Shard)
    if size is not None and size % comm.world_size:
        raise ShardingError(f"{src} -> {dst}: dim {src.dim} is split unevenly ({size} over {comm.world_size} "
                            "ranks), which no all-to-all moves; gather it (-> R) first")
    return AllToAllParallelRegion.apply(x, src.dim, dst.dim, comm)
