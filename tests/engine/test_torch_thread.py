"""An engine runs all its torch work (load, model build, KV pool, calibration, steps) on one
thread of its own, never on the event loop's or a shared worker's (engine/torch_thread.py);
in_passing_thread runs a function on a thread that is gone when it returns."""

from __future__ import annotations

import threading

import pytest

import engine.engine as engine_module
import engine.executor as executor_module
from engine import Engine
from engine.torch_thread import in_passing_thread
from tests.engine.util import greedy, run_request, tiny_config


async def test_load_build_calibrate_and_steps_share_one_thread(monkeypatch):
    seen: dict[str, set[int]] = {}

    def on_thread(name, fn):
        def wrapped(*args, **kwargs):
            seen.setdefault(name, set()).add(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapped

    for name in ("load_model", "LlamaModel", "KVCache", "calibrate"):
        monkeypatch.setattr(engine_module, name, on_thread(name, getattr(engine_module, name)))
    monkeypatch.setattr(executor_module.Executor, "run_plan", on_thread("run_plan", executor_module.Executor.run_plan))
    async with Engine(tiny_config(calibrate_step_cost=True)) as engine:
        await run_request(engine, [5, 6, 7], greedy(4))
    assert set(seen) == {"load_model", "LlamaModel", "KVCache", "calibrate", "run_plan"}
    threads = set().union(*seen.values())
    assert len(threads) == 1 and threading.get_ident() not in threads


async def test_in_passing_thread_returns_raises_and_leaves_no_thread():
    before = set(threading.enumerate())
    ident = await in_passing_thread(threading.get_ident)
    assert ident != threading.get_ident()
    with pytest.raises(ValueError, match="boom"):
        await in_passing_thread(lambda: (_ for _ in ()).throw(ValueError("boom")))
    assert set(threading.enumerate()) == before


async def test_a_failed_start_shuts_its_thread_down(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no model here")

    monkeypatch.setattr(engine_module, "load_model", broken)
    before = {t for t in threading.enumerate() if t.name.startswith("stepwise-step")}
    with pytest.raises(RuntimeError, match="no model here"):
        await Engine(tiny_config()).start()
    for t in threading.enumerate():
        if t.name.startswith("stepwise-step") and t not in before:
            t.join(timeout=5)
            assert not t.is_alive()
