"""The whole dashboard on a fixed scripted state, against a committed SVG reference.

Fixed terminal size, fixed data (monitor.scripted.example_history: seeded, no clock), and
nothing on screen reads the time. The reference belongs to the pinned Textual/Rich versions
(textual 8.2): after an upgrade, or under TEXTUAL_FILTERS, expect to regenerate it. After an intended change to the look, regenerate with

    STEPWISE_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/monitor/test_snapshot.py

and look at the new tests/monitor/snapshots/dashboard.svg before committing it.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from monitor.screenshot import render_example
from tests.monitor.helpers import screen_lines

REFERENCE = Path(__file__).parent / "snapshots" / "dashboard.svg"


async def test_dashboard_matches_reference(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)  # read by App(); would drop every colour
    svg = await render_example()
    if os.environ.get("STEPWISE_UPDATE_SNAPSHOTS"):
        # Writing the reference compares nothing: it is a skip, never a pass, and CI refuses it.
        assert not os.environ.get("CI"), "STEPWISE_UPDATE_SNAPSHOTS is set in CI: the snapshot would check nothing"
        REFERENCE.parent.mkdir(parents=True, exist_ok=True)
        REFERENCE.write_text(svg)
        pytest.skip(f"wrote {REFERENCE}: look at it before committing it")
    expected = REFERENCE.read_text()
    if svg == expected:
        return
    actual = tmp_path / "dashboard.actual.svg"
    actual.write_text(svg)
    diff = "\n".join(difflib.unified_diff(screen_lines(expected), screen_lines(svg), "reference", "actual",
                                          lineterm="", n=1))
    raise AssertionError(
        f"the dashboard differs from {REFERENCE.name} (actual: {actual}).\n"
        + (f"Screen text diff:\n{diff}" if diff else "Same text: colours or styles changed.")
        + "\nIf the change is intended: STEPWISE_UPDATE_SNAPSHOTS=1 pytest tests/monitor/test_snapshot.py"
    )
