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

from engine.attention.backend import LayerAttention, as_cached, store_kv
from engine.attention.metadata import AttentionMetadata


def window_mask(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[..., Lq, S] bool, True = attend: causal, and within `window` positions when set."""
    q, k = q_pos[..., :, None], key_pos[..., None, :]
    mask = k <= q
    return mask if window is None else mask & (k > q - window)


@dataclass
class FreshGroup:
    token_idx: torch.Tensor  # [n, L] rows of the flattened batch, one row per sequence
    masks: dict = field(default_factory=dict)  # window -> [L, L] bool

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            pos = torch.arange(self.token_idx.shape[1], device=self.token_idx.device)
            self.masks[window] = window_mask(pos, pos, window)
        return self.masks[window]


@dataclass
class DecodeGroup:
    token_idx: torch.Tensor  # [Bd] rows of the flattened batch
    slots: torch.Tensor  # [Bd, Lmax] cache slots to gather (0 where masked)
    seq_lens: torch.Tensor  # [Bd] int64: the query sits at position seq_len - 1
    masks: dict = field(default_factory=dict)  # window -> [Bd, 1, 1, Lmax] bool

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            pos = torch.arange(self.slots.shape[1], device=self.slots.device)
            self.masks[window] = window_mask((self.seq_lens - 1)[:, None], pos, window)[:, None]
        return self.masks[window]


@dataclass
class CachedChunk:
    start: int
    length: int
    slots: torch.Tensor  # [S] cache slots of the whole sequence
    masks: dict = field(default_factory=dict)  # window -> [1, 1, length, S] bool

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            seq_len = self.slots.shape[0]
            key_pos = torch.arange(seq_len, device=self.slots.device)
            self.masks[window] = window_mask(key_pos[seq_len - self.length :], key_pos, window)[None, None]
        return self.masks[window]


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


def attend(q, k, v, mask: torch.Tensor | None, layer: LayerAttention, group: int) -> torch.Tensor:
    """q: [B, H, L, D], k/v: [B, H / group, S, D], mask broadcastable to [B, H, L, S] (None =
    causal). SDPA, or, with soft-capping (which SDPA lacks), transformers' eager arithmetic."""
    if layer.softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=layer.scale, enable_gqa=group > 1
        )
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh(q @ k.transpose(-1, -2) * layer.scale / layer.softcap) * layer.softcap  # [B, H, L, S]
    if mask is None:
        pos = torch.arange(q.shape[2], device=q.device)
        mask = window_mask(pos, pos, None)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class TorchAttention:
    """Decode keys/values are gathered into a workspace reused across layers and steps:
    allocating ~50 MB per layer made fresh pages (and their faults) cost more than the copy."""

    name = "torch"

    def __init__(self) -> None:
        self._workspaces: dict[torch.dtype, torch.Tensor] = {}  # one per dtype: the cache's, and q's over a narrow cache

    def _buffers(self, n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat buffers of n elements each (grown when a step needs more)."""
        ws = self._workspaces.get(dtype)
        if ws is None or ws.numel() < 2 * n or ws.device != device:
            ws = self._workspaces[dtype] = torch.empty(2 * n, dtype=dtype, device=device)
        return ws[:n], ws[n : 2 * n]

    def _gather(self, k_flat, v_flat, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at slots of both caches ([S, KVH, D] each), in dtype: a narrow cache
        (kv_cache_dtype) is widened into a second workspace rather than a fresh copy per layer."""
        n = slots.numel() * k_flat[0].numel()
        k_buf, v_buf = (b.view(-1, *k_flat.shape[1:]) for b in self._buffers(n, k_flat.dtype, k_flat.device))
        torch.index_select(k_flat, 0, slots, out=k_buf)
        torch.index_select(v_flat, 0, slots, out=v_buf)
        if k_flat.dtype == dtype:
            return k_buf, v_buf
        k_wide, v_wide = (b.view_as(k_buf) for b in self._buffers(n, dtype, k_flat.device))
        return k_wide.copy_(k_buf), v_wide.copy_(v_buf)

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
                plan.chunks.append(CachedChunk(starts[i], q_len, slots))
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
            plan.decode = DecodeGroup(token_idx, slots, seq_lens)
        return plan

    def forward(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, plan: TorchPlan, layer: LayerAttention | None = None
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, plan.valid)
        k, v = as_cached(k, v, k_cache)
        num_heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        layer = layer or LayerAttention.plain(head_dim)
        window = layer.window
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
            # the window only bites past its own length; below that, plain causal
            mask = g.mask(window) if window is not None and window < length else None
            o = attend(qs, ks, vs, mask, layer, group)
            out[g.token_idx.reshape(-1)] = o.transpose(1, 2).reshape(n * length, num_heads, head_dim)
        if plan.decode is not None:
            d = plan.decode
            bd = d.token_idx.shape[0]
            k_flat = k_cache.view(-1, kv_heads, head_dim)
            v_flat = v_cache.view(-1, kv_heads, head_dim)
            max_len = d.slots.shape[1]
            k_buf, v_buf = self._gather(k_flat, v_flat, d.slots.view(-1), q.dtype)
            ks = k_buf.view(bd, max_len, kv_heads, head_dim).permute(0, 2, 1, 3)  # [Bd, KVH, Lmax, D]
            vs = v_buf.view(bd, max_len, kv_heads, head_dim).permute(0, 2, 1, 3)
            # Fold the query heads of one kv head into the query axis: no repeat of K/V.
            qs = q[d.token_idx].view(bd, kv_heads, group, head_dim)  # [Bd, KVH, G, D]
            o = attend(qs, ks, vs, d.mask(window), layer, 1)
            out[d.token_idx] = o.reshape(bd, num_heads, head_dim)
        for c in plan.chunks:
            k_flat = k_cache.view(-1, kv_heads, head_dim)
            v_flat = v_cache.view(-1, kv_heads, head_dim)
            ks = k_flat[c.slots].to(q.dtype).transpose(0, 1)[None]  # [1, KVH, S, D]
            vs = v_flat[c.slots].to(q.dtype).transpose(0, 1)[None]
            qs = q[c.start : c.start + c.length].transpose(0, 1)[None]  # [1, H, L, D]
            o = attend(qs, ks, vs, c.mask(window), layer, group)
            out[c.start : c.start + c.length] = o[0].transpose(0, 1)
        return out
