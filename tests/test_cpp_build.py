"""engine/cpp_build.py: a build's lock file left by a killed build never hangs the next one."""

from __future__ import annotations

import os
import threading
import time

from engine.cpp_build import _STALE_LOCK_S, _wait_for_lock


def test_a_lock_that_turns_stale_while_waited_on_is_dropped(tmp_path):
    """The lock was judged once: one 8 minutes old (a build killed 8 minutes earlier) was waited
    on by torch for ever, hanging the next test run."""
    lock = tmp_path / "lock"
    lock.touch()
    young = time.time() - _STALE_LOCK_S + 0.3  # stale in 0.3 s
    os.utime(lock, (young, young))
    started = time.monotonic()
    _wait_for_lock(lock, poll_s=0.05)
    assert not lock.exists() and time.monotonic() - started < 10


def test_a_build_in_progress_is_waited_for(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()  # the other process's build finishes
    _wait_for_lock(lock, poll_s=0.05)
    assert not lock.exists()
    _wait_for_lock(lock)  # no lock: returns at once
