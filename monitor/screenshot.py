"""Render the dashboard on a fixed, scripted state (no engine, no clock) to SVG / PNG.

    python -m monitor.screenshot docs/monitor.svg      # also writes docs/monitor.png if it can

The same state backs the snapshot test in tests/monitor, so the documentation picture and
the reference the test compares against come from one place.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

from monitor.app import MonitorApp
from monitor.scripted import ScriptedSource, example_history

SIZE = (140, 46)
DESCRIPTION = "http://127.0.0.1:8000"


async def settle(pilot, predicate, timeout_s: float = 10.0) -> None:
    """Let the app process messages until `predicate()` holds (bounded, no sleeps)."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await pilot.pause()
    await pilot.pause()


async def render_example(size: tuple[int, int] = SIZE) -> str:
    """The SVG of the dashboard after it has shown the whole example history."""
    records, state = example_history()
    app = MonitorApp(ScriptedSource(records, state, description=DESCRIPTION), min_refresh_interval_s=0)
    async with app.run_test(size=size) as pilot:
        await settle(pilot, lambda: app.steps_shown == len(records) and app.monitor.snapshot == state.snapshot
                     and app.query_one("RequestTable").snapshot == state.snapshot)
        return app.export_screenshot(title="Stepwise monitor")


def svg_to_png(svg_path: Path, png_path: Path, width: int = 1800) -> bool:
    """Convert with rsvg-convert or cairosvg, whichever is there. Rich's SVG spaces text with
    &#160; plus textLength, which librsvg draws too narrow; plain spaces under
    xml:space="preserve" render the same in browsers and right in librsvg."""
    svg = svg_path.read_text()
    fixed = svg.replace("<svg ", '<svg xml:space="preserve" ', 1).replace("&#160;", " ")
    if shutil.which("rsvg-convert"):
        subprocess.run(["rsvg-convert", "-w", str(width), "-o", str(png_path)], input=fixed.encode(), check=True)
        return True
    try:
        import cairosvg  # type: ignore[import-not-found]
    except ImportError:
        return False
    cairosvg.svg2png(bytestring=fixed.encode(), write_to=str(png_path), output_width=width)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "docs/monitor.svg")
    out.parent.mkdir(parents=True, exist_ok=True)
    svg = asyncio.run(render_example())
    out.write_text(svg)
    print(f"wrote {out}")
    png = out.with_suffix(".png")
    if svg_to_png(out, png):
        print(f"wrote {png}")
    else:
        print("no rsvg-convert or cairosvg: PNG skipped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
