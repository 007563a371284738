"""The whole dashboard on a fixed scripted state, against a committed SVG reference.

Fixed terminal size, fixed data (monitor.scripted.example_history: seeded, no clock), and
nothing on screen reads the time. The reference belongs to the pinned Textual/Rich versions
(textual 8.2): after an upgrade, or under TEXTUAL_FILTERS, expect to regenerate it. After an intended change to the look, regenerate with

    STEPWISE_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/monitor/test_snapshot.py

and look at the new tests/monitor/snapshots/dashboard.svg before committing it.
"""

from __future__ import annotations

import difflib
import html
import os
import re
from pathlib import Path

from monitor.screenshot import render_example

REFERENCE = Path(__file__).parent / "snapshots" / "dashboard.svg"
TEXT = re.compile(r'<text [^>]*clip-path="url\(#terminal-\d+-line-(\d+)\)">(.*?)</text>')


def screen_lines(svg: str) -> list[str]:
    """The characters on screen, row by row, read back from the SVG (for a readable diff)."""
    rows: dict[int, str] = {}
    for row, chunk in TEXT.findall(svg):
        rows[int(row)] = rows.get(int(row), "") + html.unescape(chunk).replace("\xa0", " ")
    return [rows.get(i, "") for i in range(max(rows, default=-1) + 1)]


async def test_dashboard_matches_reference(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)  # read by App(); would drop every colour
    svg = await render_example()
    if os.environ.get("STEPWISE_UPDATE_SNAPSHOTS"):
        REFERENCE.parent.mkdir(parents=True, exist_ok=True)
        REFERENCE.write_text(svg)
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
