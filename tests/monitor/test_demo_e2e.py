"""engine-monitor --demo on the real model: an embedded engine under the synthetic load
feeds the dashboard, and steps mixing prefill and decode items show up."""

from __future__ import annotations

import asyncio

import pytest

from monitor.app import MonitorApp, StepReceived
from monitor.cli import build_parser, make_source
from monitor.demo import EngineSource, LoadSettings
from monitor.widgets import StatusBar, StepPanel, StepStrip
from tests.monitor.helpers import plain, strip_columns, until

SMALL = """
[scheduler]
policy = "chunked"
max_num_batched_tokens = 64
chunk_size = 32
max_num_seqs = 16
[cache]
num_blocks = 256
"""


@pytest.mark.real_model
async def test_demo_shows_steps_mixing_prefill_and_decode(real_model, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(SMALL)
    args = build_parser().parse_args(["--demo", "--config", str(config), "--model", "smollm2-135m"])
    source = make_source(args, loaded=real_model)
    assert isinstance(source, EngineSource) and source.config.scheduler.max_num_batched_tokens == 64
    # a quicker load than the default so the test takes seconds: a 160-token prompt at once
    source.load_settings = LoadSettings(chat_rate_per_s=4.0, chat_max_tokens=(8, 24), long_first_s=0.0,
                                        long_every_s=5.0, long_prompt_tokens=160, long_max_tokens=8)

    mixed_steps: list[int] = []
    mixed = asyncio.Event()

    def hook(message) -> None:
        if isinstance(message, StepReceived):
            kinds = {it.kind for it in message.record.items}
            if {"prefill", "decode"} <= kinds:
                mixed_steps.append(message.record.step)
                mixed.set()

    app = MonitorApp(source, state_interval_s=0.2)
    async with app.run_test(size=(120, 44), message_hook=hook) as pilot:
        async with asyncio.timeout(120):
            await mixed.wait()
        await until(pilot, lambda: app.monitor.num_steps_seen and app.steps_shown == app.monitor.num_steps_seen
                    and any(r.step == mixed_steps[0] for r in app.query_one(StepStrip).records), timeout_s=30)
        await pilot.pause()
        assert "● live" in plain(app.query_one(StatusBar)) and "embedded engine" in plain(app.query_one(StatusBar))
        assert "step " in plain(app.query_one(StepPanel))
        strip = app.query_one(StepStrip)
        steps = [r.step for r in strip.visible()]
        column = strip_columns(strip)[steps.index(mixed_steps[0])]
        assert {"prefill", "decode"} <= set(column)  # one column shows both kinds
        assert source.engine is not None and source.load.submitted > 0
    assert source.engine is None  # quitting stopped the embedded engine
