"""Suite-wide settings.

The plan cache (``autotp/plan_cache.py``) defaults to ``~/.cache/autotp``; the suite points
``AUTOTP_CACHE_DIR`` at a temporary folder made for this session (and removed after it), so
neither CI nor a developer's run writes plans into the user's cache, and no test reuses a plan a
previous session left. Spawned ranks inherit the variable, and so do pytest-xdist's workers (the
controller makes the folder before it starts them, and removes it after they are done): identical
graphs compiled by tests on different workers are solved once. Tests that exercise the cache set
their own folder.

Files run slowest first (:data:`SLOWEST_FIRST`, ``pytest_collection_modifyitems``): pytest-xdist
hands each worker whole files in collection order (``--dist=loadfile --no-loadscope-reorder`` in
pyproject.toml; without the latter it orders files by their number of tests), so a long file
started last would leave one worker running it alone while the other idles.

The suite's own processes (the controller, each pytest-xdist worker) collect garbage less often
than Python's default (:data:`GC_THRESHOLDS`, set in ``pytest_configure``): a worker holds torch,
Dynamo, transformers and what every test it ran left behind (500,000 objects and more), and each
automatic full collection walks all of it. Measured with ``gc.callbacks`` over a full run
(1330 CPU-s): 75 CPU-s in the workers' 79 full collections and 19 in their young ones; on
test_solver, test_teardown, test_weights and test_decompose_batched in one process, 64.7 -> 53.4
CPU-s (collections 12.0 -> 6.2). Only when garbage is collected changes, never what is: explicit
``gc.collect()`` calls (autotp's before it reads shards) run as before, and the ranks are forked
from a server with their own settings (``autotp/_rank_server.py``).

``--cpu-per-file`` prints, after the run, the CPU seconds (user + sys) each test file cost
(:class:`CpuPerFile`). On a machine shared with other work this is what a file costs, where its
wall time is what the machine had left to give it.
"""

from __future__ import annotations

import gc
import os
import resource
import shutil
import tempfile
from collections import defaultdict

import pytest

from tests._probe import log_test

_CACHE_DIR = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-per-file", action="store_true",
                     help="print the CPU seconds (user + sys) of each test file: the test process's own, its "
                          "waited-for children's and its ranks'")


#: the heaviest test files, costliest first: every file of at least 20 CPU seconds (ranks included) in a
#: full quiet run with --cpu-per-file at 7e8849e (1302.7 CPU-s in all, 708.6 s wall): test_architectures
#: 163.8, the real-width matrix 132.5 (one process: its whole cost is wall on one worker), test_uneven_heads
#: 97.0, test_mesh 71.0, test_plan_depth 66.1, ... down to test_generation 22.0; files not listed follow in
#: collection order. Only the order changes: a file missing here still runs, and a stale ranking costs some
#: balance, never a test
SLOWEST_FIRST = [
    "tests/distributed/test_architectures.py", "tests/unit/test_plans_at_real_widths.py",
    "tests/distributed/test_uneven_heads.py", "tests/distributed/test_mesh.py", "tests/unit/test_plan_depth.py",
    "tests/distributed/test_stored_graphs.py", "tests/unit/test_plan_cache.py", "tests/unit/test_solver.py",
    "tests/distributed/test_rank_failure.py", "tests/distributed/test_checkpoints.py",
    "tests/unit/test_report_cache.py", "tests/distributed/test_parallelize.py", "tests/unit/test_layer_regions.py",
    "tests/test_plan_cli.py", "tests/distributed/test_kv_head_groups.py", "tests/distributed/test_inner_compile.py",
    "tests/distributed/test_dropout.py", "tests/distributed/test_batched_attention.py",
    "tests/distributed/test_generation.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the files of :data:`SLOWEST_FIRST` first, in its order; the tests of a file keep theirs."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


#: (young, middle, full) thresholds for the suite's processes, for Python's (700, 10, 10): a young
#: collection after 2000 net allocations, a full one after 100 middle ones (see the module docstring)
GC_THRESHOLDS = (2000, 10, 100)


def pytest_configure(config: pytest.Config) -> None:
    gc.set_threshold(*GC_THRESHOLDS)
    if config.getoption("cpu_per_file"):
        config.pluginmanager.register(CpuPerFile(), "cpu-per-file")
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller's folder is in its environment
        return
    folder = tempfile.mkdtemp(prefix="autotp-test-plans-")
    config.stash[_CACHE_DIR] = folder
    os.environ["AUTOTP_CACHE_DIR"] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_CACHE_DIR, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


class CpuPerFile:
    """CPU seconds per test file, measured around each test from its setup to its teardown (module
    fixtures count in the first test that uses them): the test process's own, its waited-for
    children's (CLI subprocesses, torchrun and its workers) and its ranks' (forked from the
    forkserver, not its children: ``tests/_dist.py: RANK_CPU``). Under pytest-xdist each worker
    measures its tests and sends the figure with the teardown report; the controller adds them up.
    Not in any file: what a process spends before its first test (imports, collection) and the
    forkserver's one-off preload."""

    def __init__(self) -> None:
        self.at_setup: dict[str, float] = {}
        self.per_file: dict[str, float] = defaultdict(float)

    @staticmethod
    def cpu_s() -> float:
        from tests._dist import RANK_CPU

        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + RANK_CPU.total_s

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.at_setup[item.nodeid] = self.cpu_s()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
        report = yield
        if call.when == "teardown" and item.nodeid in self.at_setup:
            report.user_properties.append(("cpu_s", self.cpu_s() - self.at_setup.pop(item.nodeid)))
            log_test(item.nodeid, report.user_properties[-1][1])  # AUTOTP_TEST_PROBE_LOG (tests/_probe.py)
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == "cpu_s" and report.when == "teardown":
                self.per_file[report.nodeid.split("::")[0]] += value

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        terminalreporter.section("CPU seconds per test file (user + sys, with children and ranks)")
        for path, seconds in sorted(self.per_file.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{seconds:9.1f}  {path}")
        terminalreporter.write_line(f"{sum(self.per_file.values()):9.1f}  in all")
