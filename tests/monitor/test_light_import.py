"""Attaching the monitor to a server needs only the messages: it must not import torch (a few
seconds of start-up), while the library names stay importable from `engine`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_monitor_http_path_does_not_import_torch():
    out = _run("import sys, monitor.cli, monitor.app, monitor.http_source, engine.messages; print('torch' in sys.modules)")
    assert out == "False"


def test_engine_names_resolve_on_first_use():
    import engine

    assert engine.SamplingParams(max_tokens=3).max_tokens == 3
    assert engine.Engine.__module__ == "engine.engine" and "Engine" in engine.__all__
    with pytest.raises(AttributeError, match="NoSuchThing"):
        engine.NoSuchThing  # noqa: B018
