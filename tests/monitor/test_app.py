"""The dashboard on a scripted step stream: composition, pause, disconnect/reconnect, keys."""

from __future__ import annotations

import msgspec
import pytest

from monitor.app import HelpScreen, MonitorApp
from monitor.scripted import ScriptedSource
from monitor.source import Backoff, ReplicaInfo
from monitor.widgets import DEFAULT_ZOOM, LatencyPanel, QueuePanel, RequestTable, StatusBar, StepPanel, StepStrip
from tests.monitor.helpers import MIXED_ITEMS, decodes, plain, record, screen_lines, state, strip_columns, until

SIZE = (120, 44)

MIXED = record(7, MIXED_ITEMS, itl=(0.08, 0.12))


def make_app(source: ScriptedSource) -> MonitorApp:
    return MonitorApp(source, state_interval_s=0.01, backoff=Backoff(0.0), min_refresh_interval_s=0)


async def test_current_step_and_strip_show_the_scripted_composition():
    history = [decodes(s) for s in range(1, 7)]
    source = ScriptedSource([*history, MIXED], state(7, [("long-1", 1500, 576, 0, 32), ("chat-2", 30, 30, 10, 64)]))
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 7 and app.query_one(RequestTable).snapshot is not None)
        panel = plain(app.query_one(StepPanel))
        assert "step 7" in panel
        assert "prefill" in panel and "long-1" in panel and "192 tok" in panel
        assert "pos 384–575 of 1,500" in panel  # the chunk's position range, and the prompt length from the snapshot
        assert "decode ×2" in panel and "chat-2@40" in panel and "chat-3@12" in panel
        assert "padding" in panel and "stale-4" in panel
        assert "198/256 (77%)" in panel  # budget used: 192 + 2 + 4

        strip = app.query_one(StepStrip)
        assert [r.step for r in strip.visible()] == list(range(1, 8))
        columns = strip_columns(strip)
        last = columns[-1]
        filled = [k for k in last if k is not None]
        # stacked bottom-up: decode, then prefill, then padding; prefill dominates
        assert filled[0] == "decode" and filled[-1] == "padding"
        assert filled.count("prefill") > filled.count("decode") >= 1 and filled.count("padding") >= 1
        assert filled == sorted(filled, key=["decode", "prefill", "padding"].index)
        for col in columns[:-1]:  # the decode-only steps
            assert {k for k in col if k} == {"decode"}

        queues = plain(app.query_one(QueuePanel))
        assert "running 4" in " ".join(queues.split())
        table = app.query_one(RequestTable)
        assert table.row_count == 2
        first_row = [str(c) for c in table.get_row_at(0)]
        assert first_row[0] == "long-1" and "576/1,500" in first_row[3]  # prefilling requests come first


async def test_pause_freezes_the_view_and_resume_catches_up():
    source = ScriptedSource([decodes(1), decodes(2), MIXED], state(7))
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 3)
        await pilot.press("p")
        await pilot.pause()
        assert "PAUSED" in plain(app.query_one(StatusBar))
        frozen = app.export_screenshot()

        source.push(*(decodes(s, n=5) for s in range(8, 14)))
        source.set_state(state(13, [("x", 10, 10, 3, 8)]))
        await until(pilot, lambda: app.monitor.num_steps_seen == 9 and app.monitor.snapshot.step == 13)
        await pilot.pause()
        assert app.steps_shown == 3
        assert "step 7" in plain(app.query_one(StepPanel))
        assert app.export_screenshot() == frozen  # nothing on screen moved

        await pilot.press("p")
        await until(pilot, lambda: app.steps_shown == 9)
        assert "step 13" in plain(app.query_one(StepPanel))
        assert "PAUSED" not in plain(app.query_one(StatusBar))
        assert [r.step for r in app.query_one(StepStrip).visible()][-1] == 13
        assert app.query_one(RequestTable).row_count == 1


@pytest.mark.parametrize("how", ["end", "raise"])
async def test_disconnected_state_and_recovery(how):
    source = ScriptedSource([decodes(1), decodes(2)], state(2))
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 2 and app.monitor.status.kind == "connected")
        assert "● live" in plain(app.query_one(StatusBar))

        if how == "end":
            source.end()
        else:
            source.fail(RuntimeError("socket went away"))
        await until(pilot, lambda: app.monitor.status.kind == "disconnected")
        await pilot.pause()
        status = plain(app.query_one(StatusBar))
        assert "disconnected — retrying" in status
        assert ("stream ended" if how == "end" else "RuntimeError: socket went away") in status
        assert "step 2" in plain(app.query_one(StepPanel))  # the last data stays on screen

        source.push(decodes(3), decodes(4))
        source.resume()
        await until(pilot, lambda: app.steps_shown == 4 and app.monitor.status.kind == "connected")
        await pilot.pause()
        assert "● live" in plain(app.query_one(StatusBar))
        assert "step 4" in plain(app.query_one(StepPanel))
        assert [r.step for r in app.query_one(StepStrip).visible()] == [3, 4]  # a new connection, a new history
        assert source.connections == 2


async def test_a_server_back_without_steps_shows_no_old_step_as_live():
    source = ScriptedSource([decodes(1), decodes(2)], state(2, [("r0", 10, 10, 5, 64)]))
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 2)
        source.end()
        await until(pilot, lambda: app.monitor.status.kind == "disconnected")
        source.set_state(state(0))  # restarted, idle
        source.resume()
        await until(pilot, lambda: app.monitor.status.kind == "connected" and app.monitor.snapshot.step == 0)
        await pilot.pause()
        assert "waiting for the first step" in plain(app.query_one(StepPanel))
        assert "running 0" in plain(app.query_one(QueuePanel))


async def test_not_up_yet_shows_connecting_then_live():
    source = ScriptedSource([decodes(1)], up=False)
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert "connecting…" in plain(app.query_one(StatusBar))
        assert "waiting for the first step" in plain(app.query_one(StepPanel))
        source.resume()
        await until(pilot, lambda: app.steps_shown == 1)
        assert "● live" in plain(app.query_one(StatusBar))


async def test_engine_restart_clears_history():
    source = ScriptedSource([decodes(s) for s in range(1, 6)])
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 5)
        source.push(decodes(1), decodes(2))  # step numbers start over: a new engine
        await until(pilot, lambda: app.steps_shown == 7)
        assert [r.step for r in app.query_one(StepStrip).visible()] == [1, 2]


async def test_zoom_and_help_keys():
    source = ScriptedSource([decodes(s) for s in range(1, 200)])
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 199)
        strip = app.query_one(StepStrip)
        assert strip.zoom == DEFAULT_ZOOM
        before = len(strip.visible())
        await pilot.press("plus")
        assert strip.zoom == DEFAULT_ZOOM + 1 and len(strip.visible()) < before
        await pilot.press("minus", "minus")
        assert strip.zoom == DEFAULT_ZOOM - 1 and len(strip.visible()) > before
        for _ in range(10):
            await pilot.press("minus")
        assert strip.zoom == 0  # clamped
        assert "cell(s) per step" in str(strip.border_title)

        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_latency_panel_figures():
    # request "a": first token at step 1 (TTFT 0.5 s), then one token per 0.1 s step
    recs = [record(s, [("a", "prefill" if s == 1 else "decode", 1, s)], ttft=(0.5,) if s == 1 else (),
                   itl=(0.1,) if s > 1 else (), duration=0.1) for s in range(1, 11)]
    app = make_app(ScriptedSource(recs))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 10)
        view = app.query_one(LatencyPanel).view
        assert view.ttft_p50 == pytest.approx(0.5)
        assert view.itl_p50 == pytest.approx(0.1) and view.itl_p99 == pytest.approx(0.1)
        assert view.tokens_per_s == pytest.approx(10 / 1.0)  # 10 tokens over 10 steps of 0.1 s
        assert len(view.itl_series) == 9


async def test_quit_key_closes_the_source():
    closed = []

    class Source(ScriptedSource):
        async def close(self):
            closed.append(True)

    app = make_app(Source([decodes(1)]))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 1)
        await pilot.press("q")
    assert closed == [True]


async def test_continuous_policy_has_no_budget_line():
    # continuous: token_budget 0; a long prompt goes in whole and its step takes long (a stall)
    def cont(step, items, duration=0.25):
        return record(step, items, budget=0, duration=duration, policy="continuous")

    recs = [cont(1, [("r0", "decode", 1, 41)]), cont(2, [("r0", "decode", 1, 42)]),
            cont(3, [("long", "prefill", 1500, 0), ("r0", "decode", 1, 43)], duration=3.0),
            cont(4, [("r0", "decode", 1, 44), ("long", "decode", 1, 1500), ("r1", "decode", 1, 7)])]
    app = make_app(ScriptedSource(recs))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 4)
        strip = app.query_one(StepStrip)
        lines = strip.render().plain.split("\n")
        assert not any("─" in line for line in lines)  # no budget line
        assert lines[-2].strip().startswith("3.00s t")  # the stall is the longest step shown
        cols = strip_columns(strip)
        assert cols[2].count("prefill") > 5 * cols[2].count("decode") >= 5
        assert cols[0] == ["decode"] + [None] * (len(cols[0]) - 1)
        assert "3 tokens (no step budget)" in plain(app.query_one(StepPanel))


async def test_request_table_updates_in_place_and_keeps_its_order():
    source = ScriptedSource([decodes(1)], state(1, [("a", 50, 50, 1, 8), ("b", 300, 100, 0, 8)]))
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(RequestTable)
        await until(pilot, lambda: table.snapshot is not None)
        ids = lambda: [str(table.get_row_at(i)[0]) for i in range(table.row_count)]  # noqa: E731
        assert ids() == ["b", "a"]  # still prefilling first
        source.set_state(state(2, [("a", 50, 50, 2, 8), ("b", 300, 300, 1, 8), ("c", 20, 0, 0, 4)]))
        source.push(decodes(2))
        await until(pilot, lambda: table.snapshot is not None and table.snapshot.step == 2)
        assert ids() == ["c", "a", "b"]
        assert "2/8" in str(table.get_row_at(1)[4])
        source.set_state(state(3, [("c", 20, 20, 1, 4)]))
        source.push(decodes(3))
        await until(pilot, lambda: table.snapshot.step == 3)
        assert ids() == ["c"]
        source.set_state(state(4, [("[/]x", 20, 20, 1, 4)]))  # a server's id is text: as markup it raised
        source.push(decodes(4))  # MarkupError and the monitor exited
        await until(pilot, lambda: table.snapshot.step == 4)
        assert ids() == ["[/]x"] and app.is_running


async def test_a_broken_source_is_reported_and_retried():
    class Broken(ScriptedSource):
        calls = 0

        def steps(self):  # a bug: not an async iterator the first time
            Broken.calls += 1
            return None if Broken.calls == 1 else super().steps()

    source = Broken([decodes(1)])
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 1)
        assert "● live" in plain(app.query_one(StatusBar))


async def test_a_crashing_worker_is_reported_and_restarted():
    class Crashing(ScriptedSource):
        reads = 0

        @property
        def connecting_activity(self):  # read by follow() itself: the worker dies the first time
            Crashing.reads += 1
            if Crashing.reads == 1:
                raise ValueError("bad source")
            return "connecting"

    app = MonitorApp(Crashing([decodes(1)]), backoff=Backoff(0.0), min_refresh_interval_s=0)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "monitor error" in app.monitor.status.reason)
        assert "disconnected — retrying in 1.0 s · monitor error: ValueError: bad source" in plain(
            app.query_one(StatusBar))
        await until(pilot, lambda: app.steps_shown == 1)
        assert Crashing.reads >= 2 and app.monitor.status.kind == "connected"


async def test_steps_keep_flowing_while_help_is_open():
    source = ScriptedSource([decodes(1)])
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 1)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        source.push(decodes(2), decodes(3))
        source.end()
        await until(pilot, lambda: app.steps_shown == 3 and app.monitor.status.kind == "disconnected")
        await pilot.press("escape")
        assert "step 3" in plain(app.query_one(StepPanel))


@pytest.mark.parametrize("size", [(40, 12), (80, 24), (220, 70)])
async def test_any_terminal_size_renders(size):
    from monitor.scripted import example_history

    records, st = example_history(60)
    app = make_app(ScriptedSource(records, st))
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: app.steps_shown == 60)
        strip, shown = app.query_one(StepStrip), []
        for zoom in range(6):  # every zoom level draws at every size
            strip.zoom = zoom
            await pilot.pause()
            lines = screen_lines(app.export_screenshot())
            assert len(lines) == size[1] and any(line.strip() for line in lines)  # the whole screen is drawn
            shown.append(len(strip.visible()))
        # wider cells, fewer steps: the strip lays itself out to the terminal's width at every zoom
        assert all(a >= b >= 1 for a, b in zip(shown, shown[1:])) and shown[0] > shown[-1], shown


async def test_the_step_panel_shows_predicted_against_actual_forward_time():
    predicted = msgspec.structs.replace(MIXED, forward_s=0.25, predicted_s=0.2)
    source = ScriptedSource([decodes(6), predicted], state(7))
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 2)
        panel = plain(app.query_one(StepPanel))
        assert "forward 250 ms (predicted 200 ms)" in panel, panel


class ClusterSource(ScriptedSource):
    """A scripted cluster ingress: each replica has its own steps and state."""

    def __init__(self):
        super().__init__([decodes(1), decodes(2)], self.state_of("replica-0"))
        self.replica = "replica-0"

    @staticmethod
    def state_of(name: str):
        return msgspec.structs.replace(state(2), replica=name,
                                       replicas=[ReplicaInfo(name="replica-0"), ReplicaInfo(name="replica-1")])

    def select_replica(self, name: str) -> None:
        self.replica = name
        self.set_state(self.state_of(name))


async def test_replica_picker_switches_to_the_next_replica_with_a_fresh_history():
    source = ClusterSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 2 and app.monitor.replicas == ["replica-0", "replica-1"])
        await until(pilot, lambda: "replica-0 of 2 replicas" in plain(app.query_one(StatusBar)))
        await pilot.press("r")
        await until(pilot, lambda: source.connections == 2)
        source.push(decodes(1, n=5))  # the new replica's stream (its steps count from 1 again)
        await until(pilot, lambda: app.steps_shown == 3)
        await until(pilot, lambda: "replica-1 of 2 replicas" in plain(app.query_one(StatusBar)))
        assert [r.step for r in app.query_one(StepStrip).visible()] == [1]  # replica-1's own history
        assert "decode ×5" in plain(app.query_one(StepPanel))
        await pilot.press("r")
        await until(pilot, lambda: source.replica == "replica-0" and source.connections == 3)


async def test_replica_key_on_a_single_engine_changes_nothing():
    source = ScriptedSource([decodes(1)], state(1))
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 1)
        await pilot.press("r")
        await pilot.pause()
        assert source.connections == 1 and source.replica is None


async def test_a_short_terminal_opens_at_the_top_and_scrolls_by_keys():
    """At 80x24 the dashboard is taller than the screen: it used to open scrolled to the focused
    request table, the current step and queues out of view with no key to bring them back."""
    source = ScriptedSource([decodes(1), MIXED], state(7))
    app = make_app(source)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.steps_shown == 2)
        assert app.screen.scroll_y == 0 and app.screen.max_scroll_y > 0
        assert "step 7" in "\n".join(screen_lines(app.export_screenshot()))
        await pilot.press("end")
        await until(pilot, lambda: app.screen.scroll_y == app.screen.max_scroll_y)
        await pilot.press("home")
        await until(pilot, lambda: app.screen.scroll_y == 0)


async def test_the_connection_state_stays_on_a_narrow_status_line():
    source = ScriptedSource([decodes(1)], state(1))
    app = make_app(source)
    async with app.run_test(size=(40, 12)) as pilot:
        await until(pilot, lambda: app.steps_shown == 1)
        assert screen_lines(app.export_screenshot())[0].lstrip().startswith("● live")


async def test_a_static_step_counts_each_request_once():
    """Static batching sends a padded prompt as two items (its prefill and its padding)."""
    items = [("a", "prefill", 5, 0), ("a", "padding", 3, 5), ("b", "prefill", 8, 0)]
    source = ScriptedSource([record(1, items, policy="static")], state(1))
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 1)
        assert "2 requests" in plain(app.query_one(StepPanel))


BATCH_ID = "cmpl-888eae46fb074324949a1b2c3d4e5f60"  # a completions prompt list: one request per prompt


async def test_long_ids_that_differ_at_the_end_stay_distinct():
    """A prompt list's requests (`ID-0`, `ID-1`) and n > 1 choices (`ID#1`) differ only at the
    end of a long id: the panel shortens ids in the middle, not at the end."""
    ids = [f"{BATCH_ID}-{i}" for i in range(3)] + [f"{BATCH_ID}-0#1"]
    items = [(ids[0], "prefill", 16, 0)] + [(i, "decode", 1, 7) for i in ids[1:]]
    app = make_app(ScriptedSource([record(1, items)], state(1)))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.steps_shown == 1)
        text = plain(app.query_one(StepPanel))
    chips = [word for word in text.split() if word.endswith("@7")]
    assert len(chips) == 3 and len(set(chips)) == 3, chips
    assert [c[-4:] for c in chips] == ["-1@7", "-2@7", "#1@7"]
    assert "-0 " in text.splitlines()[3]  # the prefill line ends its id with -0


@pytest.mark.parametrize("size", [(80, 24), (100, 30), (120, 40)])
async def test_a_full_step_panel_says_how_much_it_hides(size):
    """Every logical line of the panel is one screen row (a long header is cut, not wrapped),
    so the closing "… N more lines" is on screen whenever items are hidden."""
    ids = [f"{BATCH_ID}-{i}" for i in range(30)]
    items = [(f"long-prompt-{i}", "prefill", 64, 128) for i in range(3)] + [(i, "decode", 1, 319) for i in ids]
    step = msgspec.structs.replace(record(1, items, budget=2048), forward_s=0.2375, predicted_s=0.2412)
    app = make_app(ScriptedSource([step], state(1)))
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: app.steps_shown == 1)
        region = app.query_one(StepPanel).content_region
        rows = screen_lines(app.export_screenshot())[region.y: region.bottom]
    rows = [row.split("│")[1].rstrip() for row in rows]  # the panel's own text, between its borders
    assert rows[0].startswith("step 1 ") and rows[1].startswith("budget ")
    assert "more lines" in rows[-1], rows
    chip_rows = [row for row in rows if "cmpl-" in row]
    assert chip_rows and all(row.endswith("@319") for row in chip_rows), rows  # whole chips: none cut or split
