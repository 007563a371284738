"""What one forward step tells attention about its flattened, unpadded batch.

A step holds B sequences; sequence i contributes `query_lens[i]` consecutive tokens to the
flattened batch (prompt chunk, single decode token, or padding), at positions
`context_lens[i] .. context_lens[i] + query_lens[i] - 1`. The first `context_lens[i]`
tokens of the sequence are already in the paged KV cache (blocks listed in
`block_tables[i]`); the new tokens' keys/values come with the batch and are stored at
`slot_mapping` (slot = block * block_size + offset; -1 = do not store, used for padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int64, cumulative query lengths
    context_lens: torch.Tensor  # [B] int32, tokens already cached before this step
    seq_lens: torch.Tensor  # [B] int32, context + query
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 where unused
    slot_mapping: torch.Tensor  # [T] int64, -1 = do not store
    block_size: int
    # Host copies, so backends can group sequences without device syncs.
    query_lens_host: list[int]
    context_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        assert len(query_lens) == len(context_lens) == len(block_tables)
        assert sum(query_lens) == len(slot_mapping)
        width = max((len(t) for t in block_tables), default=0) or 1
        table = torch.full((len(block_tables), width), -1, dtype=torch.int32)
        for i, blocks in enumerate(block_tables):
            if blocks:
                table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        ctx = torch.tensor(context_lens, dtype=torch.int32)
        qry = torch.tensor(query_lens, dtype=torch.int32)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
            context_lens=ctx.to(device),
            seq_lens=(ctx + qry).to(device),
            block_tables=table.to(device),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_size=block_size,
            query_lens_host=list(query_lens),
            context_lens_host=list(context_lens),
        )
