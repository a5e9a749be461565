from mlxkv import SamplingParams
from mlxkv.engine.request import PENDING, Request


def test_pending_outputs_are_counted_as_they_are_sampled_read_and_dropped():
    request = Request("r", [7, 8], SamplingParams(max_tokens=5))
    request.append_output(PENDING)
    request.append_output(PENDING)
    assert (request.num_pending, request.num_outputs, request.num_tokens) == (2, 0, 4)
    request.set_output(0, 11)
    assert (request.num_pending, request.num_outputs, request.output_ids) == (1, 1, [11, PENDING])
    request.append_output(PENDING)
    request.truncate_outputs(2)  # a stop at output 1: what was sampled after it goes
    assert (request.num_pending, request.output_ids, request.all_token_ids) == (1, [11, PENDING], [7, 8, 11, PENDING])
    request.drop_pending()
    assert (request.num_pending, request.output_ids, request.num_remaining) == (0, [11], 3)


def test_truncating_read_outputs_leaves_no_pending_count_behind():
    request = Request("r", [7], SamplingParams(max_tokens=5))
    for token in (1, 2, PENDING):
        request.append_output(token)
    request.truncate_outputs(1)
    assert (request.num_pending, request.output_ids, request.done_sampling) == (0, [1], False)
