"""`StepPlan`'s wire format (what rank 0 encodes, the other ranks decode unchanged), and what a plan
cannot carry yet."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.cache.batch import KVBatch
from mlxkv.cache.disk import DiskMoves
from mlxkv.cache.state_pool import StateShape
from mlxkv.engine.model_kv import ModelKV
from mlxkv.engine.parallel.step_plan import StepPlan, check_tensor_parallel
from mlxkv.engine.request import PENDING, Request
from mlxkv.engine.sampling.params import SamplingParams
from mlxkv.engine.scheduler import ScheduledBatch


def test_a_plan_with_window_groups_decodes_to_the_same_batch():
    query_lens, seq_ids = np.array([5, 1], np.int32), (7, 9)
    window = KVBatch(seq_ids, query_lens, np.array([5, 40], np.int32), np.array([[3, 0, 0], [4, 8, 9]], np.int32), 16)
    kv = KVBatch(
        seq_ids, query_lens, np.array([5, 40], np.int32), np.array([[1, 0, 0], [2, 5, 6]], np.int32), 16, {512: window}
    )
    pending, sources = np.array([5], np.int32), np.array([1], np.int32)  # the last id: the step before's row 1
    plan = StepPlan(np.arange(6, dtype=np.int32), kv, np.array([5, 0], np.int32), pending, sources, 2)
    got = StepPlan.decode(plan.encode())
    assert got.token_ids.tolist() == list(range(6)) and got.own_kv.tolist() == [5, 0] and got.samples == 2
    assert got.inputs(mx.array([40, 41], mx.uint32)).tolist() == [0, 1, 2, 3, 4, 41]
    for mine, theirs in [(got.kv, kv), (got.kv.by_window[512], window)]:
        assert theirs.seq_ids == mine.seq_ids and mine.page_size == 16
        for name in ("query_lens", "context_lens", "page_tables", "slot_mapping"):
            assert getattr(mine, name).tolist() == getattr(theirs, name).tolist()
    assert list(got.kv.by_window) == [512] and plan.encode().nbytes == 4 * 47


def test_a_plans_disk_moves_decode_as_rank_0_made_them():
    """What rank 0's disk tier did goes to the other ranks in order: pages filed and restored, each
    in its page group, under its 32-byte key."""
    keys = [bytes([i]) * 32 for i in range(4)]
    moves = DiskMoves([(None, [3, 4], keys[:2]), (512, [1], keys[2:3])], [(None, [7], keys[3:])])
    kv = KVBatch((1,), np.array([1], np.int32), np.array([9], np.int32), np.array([[2]], np.int32), 16)
    plan = StepPlan(np.zeros(1, np.int32), kv, np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), 1)
    assert StepPlan.decode(plan.encode()).disk is None
    with_moves = StepPlan.decode(replace(plan, disk=moves).encode())
    assert with_moves.disk == moves and with_moves.token_ids.tolist() == [0]


def test_recurrent_layers_are_refused_by_name_and_attention_alone_passes():
    attention = ModelKV(2, 2, 64, mx.float16)
    check_tensor_parallel(attention)
    hybrid = ModelKV(2, 2, 64, mx.float16, state_shapes=[[StateShape((4, 64), mx.float32)]])
    with pytest.raises(ValueError, match="this model has recurrent layers, which tensor parallel does not run yet"):
        check_tensor_parallel(hybrid)


def test_a_row_whose_request_was_aborted_after_scheduling_keeps_its_length():
    """An abort between scheduling and launching drops the request's pending output: its row is
    filled with zeros (its results are dropped), so the step's tokens still match its batch."""
    decoding, prompt = Request("a", [1, 2], SamplingParams()), Request("b", [3, 4, 5], SamplingParams())
    decoding.num_computed = 2
    decoding.append_output(PENDING)
    kv = KVBatch((0, 1), np.array([1, 3], np.int32), np.array([3, 3], np.int32), np.zeros((2, 1), np.int32), 16)
    batch = ScheduledBatch([decoding, prompt], [1, 3], kv, [True, True], [False, False], [0, 0], [], [[], []])
    decoding.drop_pending()  # the abort
    plan = StepPlan.of(batch, [decoding], 2)
    assert plan.token_ids.tolist() == [0, 3, 4, 5] and plan.pending.tolist() == []
