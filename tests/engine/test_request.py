"""Request: the token views the scheduler plans from."""

from engine.request import Request, SamplingParams


def test_token_slice_is_a_slice_of_all_token_ids():
    req = Request("r", [1, 2, 3, 4], SamplingParams(), None, None, 0)
    req.output_token_ids += [5, 6, 7]
    for start in range(8):
        for stop in range(start, 9):
            assert req.token_slice(start, stop) == req.all_token_ids[start:stop], (start, stop)
