"""The chunked policy: decodes first, then prefill chunks, within the token budget."""

from engine.policies import Idle, make_policy
from tests.engine.policies.view import FakeView, config, request


def plan(view, **cfg):
    return make_policy("chunked", config(**cfg)).schedule(view)


def test_decodes_first_then_running_prefills_then_newcomers_within_the_budget():
    decoding = [request(i, 4, computed=5, outputs=2) for i in range(3)]  # 6 tokens, 5 computed: 1 to go
    prefilling = request(3, 100, computed=10)
    newcomer = request(4, 50)
    view = FakeView(running=[prefilling, *decoding], waiting=[newcomer])
    decisions = plan(view, max_num_batched_tokens=40, chunk_size=32)
    got = [(d.request.request_id, d.num_tokens) for d in decisions]
    assert got == [("r0", 1), ("r1", 1), ("r2", 1), ("r3", 32), ("r4", 5)]
    assert sum(n for _, n in got) == 40


def test_the_chunk_size_caps_every_prompt_piece():
    view = FakeView(waiting=[request(0, 100), request(1, 100)])
    decisions = plan(view, max_num_batched_tokens=512, chunk_size=16)
    assert [d.num_tokens for d in decisions] == [16, 16]


def test_no_newcomer_after_a_preemption_and_idle_when_empty():
    old = request(0, 4, computed=30, outputs=27)  # 31 tokens, 30 computed
    new = request(1, 4, computed=30, outputs=27)
    view = FakeView(running=[old, new], waiting=[request(2, 8)], capacity=61)
    decisions = plan(view)
    assert [d.request for d in decisions] == [old]  # the newer decode was preempted for room
    assert view.waiting[0].request_id == "r2" and view.num_running == 1
    assert isinstance(plan(FakeView()), Idle)
