"""The dashboard App.

Data flow: a @work worker runs `follow(source)` and posts one message per event up to the
App (StepReceived, StateReceived, ConnectionChanged). The App feeds them to its
MonitorState and, unless the view is paused, hands the widgets fresh views as reactive
attributes — coalesced, so a burst of steps costs one repaint.
"""

from __future__ import annotations

import contextlib
import time

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.reactive import reactive
from textual.screen import ModalScreen
from textual.widgets import Footer, Static
from textual.worker import Worker, WorkerState

from engine.messages import StepRecord
from monitor.source import (
    Backoff, Connected, Connecting, Disconnected, EngineState, Refused, SourceEvent, StateEvent, StepEvent, StepSource,
    describe_error, follow,
)
from monitor.state import MonitorState
from monitor.widgets import (
    KIND_COLOURS, ZOOM_WIDTHS, LatencyPanel, QueuePanel, RequestTable, StatusBar, StepPanel, StepStrip, StepView,
)


class StepReceived(Message):
    def __init__(self, record: StepRecord) -> None:
        super().__init__()
        self.record = record


class StateReceived(Message):
    def __init__(self, state: EngineState) -> None:
        super().__init__()
        self.state = state


class ConnectionChanged(Message):
    def __init__(self, event: Connecting | Connected | Disconnected | Refused) -> None:
        super().__init__()
        self.event = event


HELP = f"""[b]Stepwise monitor[/b] — what the engine does, step by step

[b]Keys[/b]
  [b]q[/b]      quit
  [b]p[/b]      pause / resume the view (data keeps arriving underneath)
  [b]+ -[/b]    zoom the strip of recent steps in / out
  [b]r[/b]      next replica (a cluster: engine-serve --replicas N)
  [b]?[/b]      this help (esc closes)
  [b]home end pgup pgdn[/b]  scroll the dashboard (a terminal under ~38 rows); tab focuses the request table

[b]Colours[/b]
  [{KIND_COLOURS['prefill']}]■ prefill[/]  prompt tokens computed this step (a chunk: positions a–b of the prompt)
  [{KIND_COLOURS['decode']}]■ decode[/]   one new token for a request that is generating
  [{KIND_COLOURS['padding']}]■ padding[/]  wasted slots (static batching keeps finished requests' places)
  ─ budget   the chunked policy's per-step token budget (max_num_batched_tokens)
  [#b48ead]▆ step time[/]  each step's wall time (under continuous, a long prompt stalls every decode)

[b]Latency[/b]  TTFT = arrival → first token; ITL = gap between a request's tokens;
P50/P99 over the last 512 samples; sparklines oldest → newest.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss_help", "close")]

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help")

    def action_dismiss_help(self) -> None:
        self.dismiss(None)


class MonitorApp(App[None]):
    CSS_PATH = "monitor.tcss"
    TITLE = "Stepwise monitor"
    ENABLE_COMMAND_PALETTE = False
    AUTO_FOCUS = None  # a focused request table would scroll a terminal under ~38 rows past the top panels
    BINDINGS = [
        Binding("home", "scroll_view('home')", "top", show=False),
        Binding("end", "scroll_view('end')", "bottom", show=False),
        Binding("pageup", "scroll_view('page_up')", "page up", show=False),
        Binding("pagedown", "scroll_view('page_down')", "page down", show=False),
        Binding("q", "quit", "quit"),
        Binding("p", "toggle_pause", "pause/resume"),
        Binding("plus,equals_sign", "zoom(1)", "zoom in", key_display="+"),
        Binding("minus", "zoom(-1)", "zoom out", key_display="-"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("r", "next_replica", "next replica", show=False),  # in the help; a single engine has none
    ]

    paused: reactive[bool] = reactive(False)  # the view is frozen; data keeps arriving

    def __init__(
        self,
        source: StepSource,
        *,
        state_interval_s: float = 0.5,
        backoff: Backoff | None = None,
        min_refresh_interval_s: float = 1 / 20,
    ) -> None:
        super().__init__()
        self.source = source
        self.monitor = MonitorState()
        self._state_interval_s = state_interval_s
        self._backoff = backoff or Backoff()
        self._min_refresh = min_refresh_interval_s
        self._flush_pending = False
        self._last_flush = 0.0
        self.steps_shown = 0  # MonitorState.num_steps_seen as of the last repaint (tests wait on it)

    # --- layout -------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield StatusBar(id="status")
        with Horizontal(id="top"):
            yield StepPanel(id="step")
            yield QueuePanel(id="queues")
        yield StepStrip(id="strip")
        yield LatencyPanel(id="latency")
        yield RequestTable(id="requests")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(StatusBar).status = self.monitor.status
        self._consume()

    def action_scroll_view(self, where: str) -> None:
        getattr(self.screen, f"scroll_{where}")(animate=False)

    async def on_unmount(self) -> None:
        self.workers.cancel_group(self, "source")
        with contextlib.suppress(Exception):
            await self.source.close()

    # --- the worker: source events become messages ---------------------------------------

    @work(exclusive=True, group="source", exit_on_error=False)
    async def _consume(self) -> None:
        events = follow(self.source, state_interval_s=self._state_interval_s, backoff=self._backoff)
        async with contextlib.aclosing(events):
            event: SourceEvent
            async for event in events:
                match event:
                    case StepEvent(record):
                        self.post_message(StepReceived(record))
                    case StateEvent(state):
                        self.post_message(StateReceived(state))
                    case _:
                        self.post_message(ConnectionChanged(event))

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A bug in a source must not kill the dashboard silently: say so and start over."""
        if event.worker.group == "source" and event.state is WorkerState.ERROR:
            reason = f"monitor error: {describe_error(event.worker.error)}"
            self.monitor.on_connection(Disconnected(self.source.description, reason, 1.0, 0))
            self.query_one(StatusBar).status = self.monitor.status
            self.set_timer(1.0, self._consume)

    def on_step_received(self, message: StepReceived) -> None:
        self.monitor.add(message.record)
        self._schedule_flush()

    def on_state_received(self, message: StateReceived) -> None:
        self.monitor.on_state(message.state)
        self._schedule_flush()

    def on_connection_changed(self, message: ConnectionChanged) -> None:
        self.monitor.on_connection(message.event)
        # the connection line is live even while the view is paused
        self.query_one(StatusBar).status = self.monitor.status
        if isinstance(message.event, Connected):
            self._schedule_flush()  # a new connection starts an empty history: show it

    # --- pushing views down ---------------------------------------------------------------

    def _schedule_flush(self) -> None:
        if self.paused or self._flush_pending:
            return
        self._flush_pending = True
        wait = self._min_refresh - (time.monotonic() - self._last_flush)
        if wait > 0:
            self.set_timer(wait, self._push_views)
        else:
            self.call_later(self._push_views)  # after the messages already queued: one repaint per burst

    def _push_views(self) -> None:
        self._flush_pending = False
        if self.paused or not self.is_running:  # not running: shutting down, its panels may be gone
            return
        self._last_flush = time.monotonic()
        m = self.monitor
        self.query_one(StepPanel).view = StepView(m.last, m.prompt_lengths()) if m.last else None
        self.query_one(StepStrip).records = tuple(m.records)
        self.query_one(QueuePanel).view = m.queues()
        self.query_one(LatencyPanel).view = m.latency()
        self.query_one(RequestTable).snapshot = m.snapshot
        policy = m.last.policy if m.last else m.snapshot.policy if m.snapshot else ""
        model_name = (m.config.get("model") or {}).get("model", "")
        replica = f"{self.source.replica} of {len(m.replicas)} replicas" if self.source.replica and m.replicas else ""
        self.query_one(StatusBar).engine = " · ".join(x for x in (replica, policy, model_name, m.engine_note) if x)
        self.steps_shown = m.num_steps_seen

    # --- actions ----------------------------------------------------------------------------

    def watch_paused(self, paused: bool) -> None:
        self.query_one(StatusBar).paused = paused
        if not paused:
            self._schedule_flush()  # catch up with what arrived meanwhile

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused

    def action_zoom(self, delta: int) -> None:
        strip = self.query_one(StepStrip)
        strip.zoom = max(0, min(len(ZOOM_WIDTHS) - 1, strip.zoom + delta))

    def action_next_replica(self) -> None:
        """Watch the next replica of a cluster: a fresh history from its own step stream."""
        names = self.monitor.replicas
        if len(names) < 2:
            self.notify("one engine here: no other replica to show")
            return
        current = self.source.replica if self.source.replica in names else names[0]
        self.source.select_replica(names[(names.index(current) + 1) % len(names)])
        self.monitor.reset()
        self._consume()  # exclusive: the old replica's worker is cancelled

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())
