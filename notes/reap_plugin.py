"""Measurement only: reap the forkserver at the end of the session so /usr/bin/time counts its
ranks' CPU (a forked rank is the server's child; an unreaped server's CPU is not counted)."""
import multiprocessing.forkserver as forkserver


def pytest_unconfigure(config):
    forkserver._forkserver._stop()
