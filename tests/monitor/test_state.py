"""MonitorState: the figures the dashboard shows, without any UI."""

from __future__ import annotations

import msgspec

import pytest

from engine.messages import FinishedRequest
from monitor.source import Connected, Connecting, Disconnected
from monitor.state import MonitorState, output_tokens, percentile
from tests.monitor.helpers import decodes, record, state


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    data = list(range(1, 101))
    assert percentile(data, 50) == 50 and percentile(data, 99) == 99 and percentile(data, 100) == 100


def test_output_tokens_counts_first_and_next_tokens():
    r = record(1, [("a", "prefill", 30, 0), ("b", "decode", 1, 9), ("c", "decode", 1, 4)], ttft=(0.3,), itl=(0.1, 0.1))
    assert output_tokens(r) == 3
    assert output_tokens(record(2, [("b", "decode", 1, 10)])) == 1  # a server that leaves itl_s empty


def test_throughput_and_idle_seconds():
    m = MonitorState()
    for s in range(1, 21):  # 20 steps of 0.25 s, 3 tokens each: 12 tokens/s
        m.add(decodes(s))
    assert m.tokens_per_s() == pytest.approx(12.0)
    # a step 5 s later: the idle seconds in between count as zero in the series
    late = record(40, [("r0", "decode", 1, 1)], itl=(5.0,))
    m.add(late)
    assert m.latency().rate_series[-4:] == (0.0, 0.0, 0.0, 0.0)


def test_throughput_reads_zero_once_the_engine_is_idle():
    """The rate used to stay at the load's figure for as long as the engine stayed idle."""
    m = MonitorState()
    for s in range(1, 21):
        m.add(decodes(s))
    m.on_state(state(20, [("r0", 10, 10, 5, 64)]))  # still running
    assert m.tokens_per_s() == pytest.approx(12.0)
    m.on_state(state(19))  # nothing running, but as of an older step than the last record
    assert m.tokens_per_s() == pytest.approx(12.0)
    m.on_state(state(20))  # nothing running or waiting after the last step: idle
    assert m.tokens_per_s() == 0.0 and m.latency().tokens_per_s == 0.0


def test_finished_and_queue_view():
    m = MonitorState()
    assert m.queues() is None
    fin = [FinishedRequest("a", "stop", 1.0, 10, 5), FinishedRequest("b", "length", 2.0, 10, 8),
           FinishedRequest("c", "stop", 1.5, 10, 3)]
    import msgspec

    m.on_state(state(1, [("d", 10, 10, 3, 16)]))  # KV 0.1, 900 of 1,024 free
    m.add(msgspec.structs.replace(record(2, [("d", "decode", 1, 3)], waiting=4, kv=0.5, preemptions=2), finished=fin))
    q = m.queues()
    assert (q.num_waiting, q.num_running, q.kv_usage, q.num_preemptions) == (4, 1, 0.5, 2)
    assert (q.num_blocks, q.num_free_blocks) == (1024, 512)  # the record's moment, not the older snapshot's
    m.on_state(state(2, [("d", 10, 10, 3, 16)]))  # polled after step 2: its KV figures are newer
    q = m.queues()
    assert (q.kv_usage, q.num_blocks, q.num_free_blocks) == (0.1, 1024, 922)
    assert q.num_finished == 3 and q.finish_reasons == (("stop", 2), ("length", 1))
    assert m.prompt_lengths() == {"d": 10}
    m.add(record(500, [("d", "decode", 1, 3)], kv=0.9))
    m.on_state(state(0))  # the server restarted (steps start over) and is idle: the snapshot is the news
    assert m.queues().kv_usage == 0.1


def test_status_keeps_the_reason_while_retrying():
    m = MonitorState()
    m.on_connection(Connecting("u", 0))
    assert m.status.kind == "connecting"
    m.on_connection(Connected("u"))
    m.on_connection(Disconnected("u", "connection refused", 0.5, 1))
    m.on_connection(Connecting("u", 1))
    assert m.status.kind == "disconnected" and m.status.reason == "connection refused"
    m.on_connection(Connected("u"))
    assert m.status.kind == "connected" and m.status.reason == ""


def test_a_reconnection_starts_a_new_history():
    """A server restarted under load came back showing the dead one's last step, queues and
    rate as live: an idle new engine sends no step whose number would reveal the restart."""
    m = MonitorState()
    m.on_connection(Connected("u"))
    for s in range(300, 328):
        m.add(record(s, [(f"r{i}", "decode", 1, s) for i in range(64)], waiting=56))
    m.on_state(state(327, [("r0", 10, 10, 5, 64)]))
    assert m.queues().num_waiting == 56 and m.tokens_per_s() > 0
    m.on_connection(Disconnected("u", "connection lost", 0.5, 1))
    assert m.last.step == 327  # while disconnected the last data stays (the status says it is old)
    m.on_connection(Connecting("u", 1))
    m.on_connection(Connected("u"))
    m.on_state(state(0))  # the new engine: idle, no step yet
    q = m.queues()
    assert m.last is None and m.tokens_per_s() is None and (q.num_waiting, q.num_running) == (0, 0)
    assert m.latency().ttft_p50 is None and m.status.kind == "connected"


def test_requests_compiling_a_grammar_count_as_waiting():
    """As /metrics' num_requests_waiting does: intake holds them, no step record counts them."""
    import msgspec

    m = MonitorState()
    st = state(3)
    m.on_state(msgspec.structs.replace(st, snapshot=msgspec.structs.replace(st.snapshot, num_waiting_for_grammar=36)))
    m.add(record(3, [("a", "decode", 1, 7)], waiting=2))
    q = m.queues()
    assert (q.num_waiting, q.num_waiting_for_grammar) == (38, 36)


def test_requests_arriving_during_a_long_step_count_as_waiting():
    """Requests handed to the scheduler while step 5 runs are in no step record yet: the count
    stayed frozen for the whole step. A snapshot older than the last record is not added (its
    arrivals are in that record's queue)."""
    import msgspec

    m = MonitorState()
    m.add(record(5, [("a", "decode", 1, 7)], waiting=2))
    st = state(5)
    m.on_state(msgspec.structs.replace(st, snapshot=msgspec.structs.replace(st.snapshot, num_arriving=3)))
    assert m.queues().num_waiting == 5
    m.add(record(6, [("a", "decode", 1, 8)], waiting=5))  # the arrivals joined the queue at step 6
    assert m.queues().num_waiting == 5


def test_a_step_at_an_infinite_time_does_not_stop_the_monitor():
    """1e308 + 1e308 is inf: int(inf) raised OverflowError and the app exited."""
    m = MonitorState()
    m.add(record(1, [("a", "decode", 1, 7)]))
    m.add(msgspec.structs.replace(record(2, [("a", "decode", 1, 8)]), start_time=1e308, duration_s=1e308))
    assert m.last.step == 2 and m.tokens_per_s() is not None
