"""Paged attention in plain torch: the default backend on CPU.

Sequences in a step fall into three groups, each computed in as few SDPA calls as possible:
- fresh (no cached context: a prompt's first chunk, or padding): causal attention over the
  step's own k/v, batched across sequences of equal length;
- decodes (one new token after a cached context): batched into one SDPA call, keys gathered
  from the cache by block table and masked past each sequence's length;
- cached chunks (several new tokens after a cached context): one SDPA call each, keys
  gathered from the cache, causal mask shifted by the context length.
All gather indices and masks are built once per step in `prepare` and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.backend import store_kv
from engine.attention.metadata import AttentionMetadata


@dataclass
class FreshGroup:
    token_idx: torch.Tensor  # [n, L] rows of the flattened batch, one row per sequence


@dataclass
class DecodeGroup:
    token_idx: torch.Tensor  # [Bd] rows of the flattened batch
    slots: torch.Tensor  # [Bd, Lmax] cache slots to gather (0 where masked)
    mask: torch.Tensor  # [Bd, 1, 1, Lmax] bool, True = attend


@dataclass
class CachedChunk:
    start: int
    length: int
    slots: torch.Tensor  # [S] cache slots of the whole sequence
    mask: torch.Tensor  # [1, 1, length, S] bool


@dataclass
class TorchPlan:
    valid: torch.Tensor | None  # [T] bool, None = every slot is stored
    fresh: list[FreshGroup] = field(default_factory=list)
    decode: DecodeGroup | None = None
    chunks: list[CachedChunk] = field(default_factory=list)


def _seq_slots(table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0..length-1 of one sequence."""
    pos = torch.arange(length, device=table_row.device)
    return table_row[pos // block_size].long() * block_size + pos % block_size


class TorchAttention:
    """Decode keys/values are gathered into a workspace reused across layers and steps:
    allocating ~50 MB per layer made fresh pages (and their faults) cost more than the copy."""

    name = "torch"

    def __init__(self) -> None:
        self._workspace = torch.empty(0)

    def _buffers(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat buffers of n elements each (grown when a step needs more)."""
        if self._workspace.numel() < 2 * n or self._workspace.dtype != like.dtype or self._workspace.device != like.device:
            self._workspace = torch.empty(2 * n, dtype=like.dtype, device=like.device)
        return self._workspace[:n], self._workspace[n : 2 * n]

    def prepare(self, meta: AttentionMetadata) -> TorchPlan:
        device = meta.slot_mapping.device
        has_skip = bool((meta.slot_mapping < 0).any())
        plan = TorchPlan(valid=(meta.slot_mapping >= 0) if has_skip else None)
        starts = meta.query_start_loc.tolist()
        fresh_by_len: dict[int, list[int]] = {}
        decodes: list[int] = []
        for i, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
            if q_len == 0:
                continue
            if ctx == 0:
                fresh_by_len.setdefault(q_len, []).append(starts[i])
            elif q_len == 1:
                decodes.append(i)
            else:
                seq_len = ctx + q_len
                slots = _seq_slots(meta.block_tables[i], seq_len, meta.block_size)
                # query j (position ctx + j) sees keys 0..ctx + j
                key_pos = torch.arange(seq_len, device=device)
                q_pos = torch.arange(ctx, seq_len, device=device)
                mask = (key_pos[None, :] <= q_pos[:, None])[None, None]
                plan.chunks.append(CachedChunk(starts[i], q_len, slots, mask))
        for q_len, seq_starts in fresh_by_len.items():
            idx = torch.tensor(seq_starts, device=device)[:, None] + torch.arange(q_len, device=device)[None, :]
            plan.fresh.append(FreshGroup(idx))
        if decodes:
            rows = torch.tensor(decodes, device=device)
            seq_lens = meta.seq_lens[rows].long()  # [Bd]
            max_len = max(meta.context_lens_host[i] + 1 for i in decodes)
            pos = torch.arange(max_len, device=device)
            mask = pos[None, :] < seq_lens[:, None]  # [Bd, Lmax]
            tables = meta.block_tables[rows].long()  # [Bd, max_blocks]
            blocks = torch.gather(tables, 1, (pos // meta.block_size)[None, :].expand(len(decodes), -1).clamp(max=tables.shape[1] - 1))
            slots = torch.where(mask, blocks * meta.block_size + pos % meta.block_size, 0)
            token_idx = meta.query_start_loc[rows]
            plan.decode = DecodeGroup(token_idx, slots, mask[:, None, None, :])
        return plan

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, plan: TorchPlan) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, plan.valid)
        num_heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        group = num_heads // kv_heads
        out = torch.empty_like(q)  # [T, H, D]
        for g in plan.fresh:
            n, length = g.token_idx.shape
            if length == 1:
                # a lone token attends only to itself: softmax over one key is 1
                rows = g.token_idx[:, 0]
                out[rows] = v[rows].repeat_interleave(group, dim=1)
                continue
            qs = q[g.token_idx].transpose(1, 2)  # [n, H, L, D]
            ks = k[g.token_idx].transpose(1, 2)  # [n, KVH, L, D]
            vs = v[g.token_idx].transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=group > 1)
            out[g.token_idx.reshape(-1)] = o.transpose(1, 2).reshape(n * length, num_heads, head_dim)
        if plan.decode is not None:
            d = plan.decode
            bd = d.token_idx.shape[0]
            k_flat = k_cache.view(-1, kv_heads, head_dim)
            v_flat = v_cache.view(-1, kv_heads, head_dim)
            max_len = d.slots.shape[1]
            k_buf, v_buf = self._buffers(bd * max_len * kv_heads * head_dim, q)
            slots = d.slots.view(-1)
            k_buf = torch.index_select(k_flat, 0, slots, out=k_buf.view(-1, kv_heads, head_dim))
            v_buf = torch.index_select(v_flat, 0, slots, out=v_buf.view(-1, kv_heads, head_dim))
            ks = k_buf.view(bd, max_len, kv_heads, head_dim).permute(0, 2, 1, 3)  # [Bd, KVH, Lmax, D]
            vs = v_buf.view(bd, max_len, kv_heads, head_dim).permute(0, 2, 1, 3)
            # Fold the query heads of one kv head into the query axis: no repeat of K/V.
            qs = q[d.token_idx].view(bd, kv_heads, group, head_dim)  # [Bd, KVH, G, D]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=d.mask)
            out[d.token_idx] = o.reshape(bd, num_heads, head_dim)
        for c in plan.chunks:
            k_flat = k_cache.view(-1, kv_heads, head_dim)
            v_flat = v_cache.view(-1, kv_heads, head_dim)
            ks = k_flat[c.slots].transpose(0, 1)[None]  # [1, KVH, S, D]
            vs = v_flat[c.slots].transpose(0, 1)[None]
            qs = q[c.start : c.start + c.length].transpose(0, 1)[None]  # [1, H, L, D]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=c.mask, enable_gqa=group > 1)
            out[c.start : c.start + c.length] = o[0].transpose(0, 1)
        return out
