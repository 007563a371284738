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


class TimedView(FakeView):
    """Predicts with a known linear cost: 1 ms a token, 2 ms fixed (attention ignored)."""

    can_predict = True

    def predict(self, shape) -> float:
        return 0.002 + 0.001 * (shape.prefill_tokens + shape.decode_tokens)


def timed(view, max_step_ms=50, **cfg):
    return make_policy("chunked", config(max_step_ms=max_step_ms, min_chunk=8, **cfg)).schedule(view)


def test_the_time_budget_fills_the_step_oldest_prefill_first():
    decoding = [request(i, 4, computed=5, outputs=2) for i in range(10)]
    old, new = request(10, 500), request(11, 500)
    view = TimedView(running=decoding, waiting=[old, new])
    decisions = timed(view, max_num_batched_tokens=512, chunk_size=16)
    got = {d.request.request_id: d.num_tokens for d in decisions}
    assert all(got[f"r{i}"] == 1 for i in range(10))  # no decode is skipped
    assert got["r10"] == 38 and "r11" not in got  # 2 + 10 + 38 = 50 ms: the oldest takes it all
    assert view.predict(shape_of_decisions(decisions)) <= 0.050


def test_min_chunk_when_decodes_fill_the_budget_and_the_token_cap_holds():
    decoding = [request(i, 4, computed=5, outputs=2) for i in range(60)]
    view = TimedView(running=decoding, waiting=[request(60, 500)])
    decisions = timed(view, max_step_ms=50, max_num_batched_tokens=512)
    assert sum(d.num_tokens for d in decisions if d.request.request_id == "r60") == 8  # min_chunk
    assert len(decisions) == 61
    view = TimedView(waiting=[request(0, 500)])
    decisions = timed(view, max_step_ms=10_000, max_num_batched_tokens=100)
    assert sum(d.num_tokens for d in decisions) == 100  # the token cap stays hard


def test_without_a_fitted_model_the_token_budget_rules():
    view = FakeView(waiting=[request(0, 500), request(1, 500)])
    view.can_predict = False
    decisions = timed(view, max_num_batched_tokens=64, chunk_size=16)
    assert [d.num_tokens for d in decisions] == [16, 16]


def shape_of_decisions(decisions):
    from engine.step_cost import shape_of

    return shape_of((d.num_tokens, d.request.num_computed_tokens, d.num_tokens == 1) for d in decisions)


def test_a_younger_prompt_gets_nothing_while_the_oldest_is_cut_by_the_time_budget():
    class AttentionView(TimedView):
        def predict(self, shape) -> float:  # a long context makes the oldest prompt's tokens dearer
            return 0.002 + 0.001 * (shape.prefill_tokens + shape.decode_tokens) + 1e-6 * shape.attention_work

    old = request(0, 3000, computed=2000)  # 1,000 to go, after 2,000 cached
    view = AttentionView(running=[old], waiting=[request(1, 500)])
    decisions = timed(view, max_step_ms=50, max_num_batched_tokens=512)
    assert [d.request.request_id for d in decisions] == ["r0"]  # the slack left is not the newcomer's


def test_a_chunked_prompt_finishing_shares_its_step_only_with_prompts_that_finish_too():
    tail = request(0, 500, computed=480)  # chunked over earlier steps: its last 20 tokens
    short, long = request(1, 10), request(2, 500)
    view = TimedView(running=[tail], waiting=[short, long])
    decisions = timed(view, max_step_ms=50)
    assert [(d.request.request_id, d.num_tokens) for d in decisions] == [("r0", 20), ("r1", 10)]
    # the long newcomer's chunk waits a step: it would hold back r0's first token, not give its own
    view = TimedView(running=[request(0, 500, computed=400)], waiting=[request(1, 500)])
    decisions = timed(view, max_step_ms=50)  # r0 is cut by the time budget: no first token yet
    assert [(d.request.request_id, d.num_tokens) for d in decisions] == [("r0", 48)]
    view = TimedView(waiting=[request(0, 20), request(1, 500)])  # a prompt in one piece: no hold
    assert [d.num_tokens for d in timed(view, max_step_ms=50)] == [20, 28]
