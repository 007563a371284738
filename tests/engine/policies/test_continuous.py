"""The continuous policy: every running request's remaining tokens, whole prompts for newcomers."""

from engine.policies import make_policy
from tests.engine.policies.view import FakeView, config, request


def test_whole_prompts_and_one_decode_each():
    decoding = request(0, 4, computed=5, outputs=2)
    view = FakeView(running=[decoding], waiting=[request(1, 300), request(2, 40)])
    decisions = make_policy("continuous", config()).schedule(view)
    assert [(d.request.request_id, d.num_tokens) for d in decisions] == [("r0", 1), ("r1", 300), ("r2", 40)]


def test_a_prompt_that_does_not_fit_whole_waits():
    view = FakeView(waiting=[request(0, 300), request(1, 10)], capacity=200)
    assert make_policy("continuous", config()).schedule(view).__class__.__name__ == "Idle"
    assert len(view.waiting) == 2  # in order: the second does not jump the first


def test_max_num_seqs():
    view = FakeView(waiting=[request(i, 5) for i in range(5)])
    assert len(make_policy("continuous", config(max_num_seqs=3)).schedule(view)) == 3
