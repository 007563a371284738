"""Flattening one step's sequences into the model's inputs.

Sequence i feeds `token_ids` at positions `start_pos ..`, the last `num_padding` of them pad
tokens: they are computed but their keys/values are never stored (slot -1) and they are never
sampled, so a sequence's logits row is its last real token. The executor, the benchmarks and
the test helpers all build a step here, so that they run the model the way the engine does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata


class BatchSeq(Protocol):
    """What flattening needs of a sequence (PlanItem has these fields)."""

    token_ids: list[int]  # this step's tokens: the real ones, then num_padding pad tokens
    start_pos: int  # position of token_ids[0]; earlier tokens are in the KV cache
    block_table: list[int]  # the sequence's KV blocks, covering at least its real tokens
    num_padding: int


@dataclass(frozen=True)
class Seq:
    """A BatchSeq for callers without a PlanItem (benchmarks, tests)."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_padding: int = 0


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_rows: list[int]  # [B] row in [T] of each sequence's last real token
    meta: AttentionMetadata  # slot mapping [T] (-1 for padding), block tables [B, max_blocks]


def flatten_batch(seqs: Sequence[BatchSeq], block_size: int, device: torch.device | str = "cpu") -> FlatBatch:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    for s in seqs:
        n = len(s.token_ids)
        real = n - s.num_padding
        pos = range(s.start_pos, s.start_pos + n)
        ids += s.token_ids
        positions += pos
        table = s.block_table
        slots += [table[p // block_size] * block_size + p % block_size for p in pos[:real]]
        slots += [-1] * s.num_padding  # padding: computed, never stored
        logits_rows.append(len(ids) - s.num_padding - 1)
    meta = AttentionMetadata.build(
        query_lens=[len(s.token_ids) for s in seqs],
        context_lens=[s.start_pos for s in seqs],
        block_tables=[s.block_table for s in seqs],
        slot_mapping=slots,
        block_size=block_size,
        device=device,
    )
    return FlatBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        logits_rows=logits_rows,
        meta=meta,
    )
