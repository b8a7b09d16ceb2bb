"""The last module the test suite's rank server imports (``tests/_dist.py: PRELOAD``): with every
modeling module loaded, it fills the per-process caches of a first compile once for all the ranks
the server forks (``autotp._rank_server.warm_caches``)."""

from autotp._rank_server import warm_caches

warm_caches()
