"""A process that holds an autotp model exits without the interpreter's final walks over its heap
(``autotp/teardown.py``): an ``atexit`` handler freezes the heap, unless ``AUTOTP_FAST_EXIT=0``,
and a session's undo removes its own handler only."""

from __future__ import annotations

import atexit
import gc
import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from autotp.teardown import freeze_at_exit

#: the checker is registered before autotp's handler, so it runs after it (atexit runs handlers
#: last in, first out)
_SCRIPT = """
import atexit, gc, os
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
from autotp.teardown import freeze_at_exit
freeze_at_exit(os.environ)
"""


def test_a_process_that_registered_the_handler_exits_with_its_heap_frozen() -> None:
    env = {**os.environ, "AUTOTP_FAST_EXIT": ""}  # the default, whatever the caller's environment says
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert "frozen at exit: True" in out, out


class _Handlers:
    """atexit's registry as the module sees it, so that the handlers run here, not at this process's exit."""

    def __init__(self) -> None:
        self.handlers: list[Callable[[], None]] = []

    def register(self, fn: Callable[[], None]) -> None:
        self.handlers.append(fn)

    def unregister(self, fn: Callable[[], None]) -> None:
        self.handlers = [h for h in self.handlers if h != fn]  # atexit compares with ==, as here

    def frozen_by_running_them(self) -> bool:
        for handler in self.handlers[::-1]:
            handler()
        frozen = gc.get_freeze_count() > 0
        gc.unfreeze()
        return frozen


@pytest.mark.parametrize(("fast_exit", "undone", "frozen"), [
    ("", (), True),
    ("0", (), False),
    ("1", (0,), True),  # the other session's handler stays
    ("1", (0, 1), False),
])
def test_the_heap_is_frozen_while_a_session_holds_its_handler_unless_autotp_fast_exit_is_0(
        monkeypatch: pytest.MonkeyPatch, fast_exit: str, undone: tuple[int, ...], frozen: bool) -> None:
    registry = _Handlers()
    monkeypatch.setattr(atexit, "register", registry.register)
    monkeypatch.setattr(atexit, "unregister", registry.unregister)
    undo = [freeze_at_exit({"AUTOTP_FAST_EXIT": fast_exit}) for _ in range(2)]  # two sessions
    assert all((u is None) == (fast_exit == "0") for u in undo)
    for i in undone:
        undo[i]()
    assert registry.frozen_by_running_them() is frozen
