"""The static policy: a padded batch that runs until its longest request finishes."""

from engine.policies import Idle, make_policy
from engine.request import Status
from tests.engine.policies.view import FakeView, config, request


def test_a_batch_pads_to_its_longest_prompt_and_holds_finished_requests():
    policy = make_policy("static", config(max_num_seqs=3))
    short, long = request(0, 3), request(1, 10)
    view = FakeView(waiting=[short, long])
    assert isinstance(policy.schedule(view), Idle)  # waits for the batch to fill (or the timeout)
    view._now = short.arrival_time + 1.0  # past batch_timeout_ms
    first = policy.schedule(view)
    assert [(d.num_tokens, d.num_padding) for d in first] == [(3, 7), (10, 0)]
    short.num_computed_tokens, long.num_computed_tokens = 3, 10
    short.output_token_ids, long.output_token_ids = [7], [7]
    short.status = Status.FINISHED  # it stopped; the batch goes on
    assert policy.holds_finished(short)
    late = request(2, 4)
    view.waiting.append(late)
    second = policy.schedule(view)
    assert [(d.request, d.num_tokens, d.num_padding) for d in second] == [(short, 0, 1), (long, 1, 0)]
    policy.end_step(view)
    assert view.released == []  # not all finished yet
    long.status = Status.FINISHED
    policy.end_step(view)
    assert view.released == [short, long] and not policy.batch  # the batch ends with its last request


def test_a_full_waiting_queue_starts_the_batch_without_waiting_for_the_timeout():
    # max_waiting < max_num_seqs: intake refuses a third request, so the batch cannot fill
    policy = make_policy("static", config(max_num_seqs=8, max_waiting=2, batch_timeout_ms=60_000))
    view = FakeView(waiting=[request(0, 3)])
    assert isinstance(policy.schedule(view), Idle)  # room for one more: it waits
    view.waiting.append(request(1, 5))
    assert [(d.num_tokens, d.num_padding) for d in policy.schedule(view)] == [(3, 2), (5, 0)]
