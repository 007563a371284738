"""flatten_batch: the one place a step's sequences become token ids, positions, cache slots,
logits rows and attention metadata."""

from __future__ import annotations

import torch

from engine.batch import Seq, flatten_batch
from engine.messages import PlanItem


def test_real_tokens_are_stored_in_their_blocks_and_padding_nowhere():
    bs = 4
    seqs = [
        Seq([11, 12, 13], start_pos=2, block_table=[7, 3]),  # positions 2..4: block 7 then block 3
        Seq([21, 0, 0], start_pos=0, block_table=[5], num_padding=2),  # one real token, two pads
        Seq([31], start_pos=9, block_table=[1, 2, 6]),  # a decode at position 9: block 6, offset 1
    ]
    b = flatten_batch(seqs, bs)
    assert b.input_ids.tolist() == [11, 12, 13, 21, 0, 0, 31]
    assert b.positions.tolist() == [2, 3, 4, 0, 1, 2, 9]
    assert b.meta.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0, 5 * 4 + 0, -1, -1, 6 * 4 + 1]
    assert b.input_ids.dtype == b.positions.dtype == torch.long


def test_logits_row_is_each_sequences_last_real_token():
    seqs = [
        Seq([1, 2], 0, [0]),
        Seq([3, 9, 9, 9], 0, [1], num_padding=3),
        Seq([4, 5, 6], 0, [2]),
    ]
    assert flatten_batch(seqs, 4).logits_rows == [1, 2, 8]


def test_metadata_counts_padding_as_query_tokens():
    seqs = [Seq([1, 2, 0], 5, [0, 1], num_padding=1), Seq([3], 0, [2])]
    meta = flatten_batch(seqs, 4).meta
    assert meta.query_lens_host == [3, 1] and meta.context_lens_host == [5, 0]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.seq_lens.tolist() == [8, 1]
    assert meta.block_tables.tolist() == [[0, 1], [2, -1]]
    assert meta.num_tokens == 4


def test_plan_items_flatten_as_the_executor_sees_them():
    item = PlanItem(request_id="a", kind="prefill", token_ids=[5, 6, 0], start_pos=3, block_table=[4],
                    sample=True, num_padding=1)
    b = flatten_batch([item], 8)
    assert b.meta.slot_mapping.tolist() == [35, 36, -1]
    assert b.logits_rows == [1]
