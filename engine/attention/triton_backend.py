"""Paged attention as one Triton kernel: the default backend on CUDA.

One program per (query token, query head). Each program looks up its sequence and position
(computed once per step in `prepare`), then runs an online softmax (running max and sum,
fp32 accumulation) over two ranges of keys, in tiles of BLOCK_N:
- the cached context, positions 0..ctx-1, gathered from the paged cache by block table;
- this step's fresh keys of the same sequence, positions ctx..p, read straight from k/v
  (so padding tokens, whose slots are -1 and never stored, still attend correctly).
On a sliding-window layer both ranges start at the window's first position (p - window + 1);
scores are scaled by the layer's scale and, when it asks, tanh soft-capped (Gemma 2).
A head_dim that is not a power of two (Phi-3's 96) runs in the next power's tile, masked.
Semantics match `TorchAttention` (see backend.py / metadata.py). Simple, not tuned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.attention.backend import LayerAttention, as_cached, store_kv
from engine.attention.metadata import AttentionMetadata


@dataclass
class TritonPlan:
    valid: torch.Tensor | None  # [T] bool, None = every slot is stored
    token_seq: torch.Tensor  # [T] int32, sequence index of each token
    token_pos: torch.Tensor  # [T] int32, position of each token in its sequence


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    token_seq_ptr, token_pos_ptr, query_start_ptr, context_lens_ptr, block_tables_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_co, stride_ch, stride_cd,  # k_cache and v_cache share strides
    stride_ot, stride_oh, stride_od,
    stride_bt,
    scale, block_size, group, window, softcap, head_dim,
    D: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,  # D: head_dim rounded up to a power of two
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // group
    seq = tl.load(token_seq_ptr + t)
    pos = tl.load(token_pos_ptr + t)
    ctx = tl.load(context_lens_ptr + seq)
    q_start = tl.load(query_start_ptr + seq)

    d = tl.arange(0, D)  # [D]
    in_head = d < head_dim  # [D]: the tile's lanes past head_dim load 0 and store nothing
    n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d * stride_qd, mask=in_head, other=0.0).to(tl.float32) * scale

    m_i = tl.full((), float("-inf"), tl.float32)  # running max
    l_i = tl.full((), 0.0, tl.float32)  # running sum of exp
    acc = tl.zeros((D,), dtype=tl.float32)  # [D]
    lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)  # first visible key position

    # 1) cached context: positions 0..ctx-1, gathered through the block table.
    for start in range(lo // BLOCK_N * BLOCK_N, ctx, BLOCK_N):
        kpos = start + n  # [BLOCK_N]
        mask = (kpos < ctx) & (kpos >= lo)
        block = tl.load(block_tables_ptr + seq * stride_bt + kpos // block_size, mask=mask, other=0).to(tl.int64)
        base = block * stride_cb + (kpos % block_size) * stride_co + kvh * stride_ch  # [BLOCK_N]
        offs = base[:, None] + d[None, :] * stride_cd  # [BLOCK_N, D]
        tile = mask[:, None] & in_head[None, :]  # [BLOCK_N, D]
        kt = tl.load(k_cache_ptr + offs, mask=tile, other=0.0).to(tl.float32)
        vt = tl.load(v_cache_ptr + offs, mask=tile, other=0.0).to(tl.float32)
        s = tl.sum(kt * q[None, :], axis=1)  # [BLOCK_N]
        if SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # softcap * tanh(s / softcap)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with no visible key
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        m_i = m_new

    # 2) fresh keys of this step: positions ctx..pos, rows q_start + (position - ctx).
    num_fresh = pos - ctx + 1
    for start in range(tl.maximum(lo - ctx, 0), num_fresh, BLOCK_N):
        j = start + n  # [BLOCK_N]
        mask = j < num_fresh
        rows = (q_start + j).to(tl.int64)
        tile = mask[:, None] & in_head[None, :]  # [BLOCK_N, D]
        kt = tl.load(k_ptr + rows[:, None] * stride_kt + kvh * stride_kh + d[None, :] * stride_kd,
                     mask=tile, other=0.0).to(tl.float32)  # [BLOCK_N, D]
        vt = tl.load(v_ptr + rows[:, None] * stride_vt + kvh * stride_vh + d[None, :] * stride_vd,
                     mask=tile, other=0.0).to(tl.float32)
        s = tl.sum(kt * q[None, :], axis=1)  # [BLOCK_N]
        if SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        m_i = m_new

    o = acc / l_i
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d * stride_od, o.to(out_ptr.dtype.element_ty), mask=in_head)


class TritonAttention:
    name = "triton"

    def __init__(self, block_n: int = 16):
        assert block_n > 0 and block_n & (block_n - 1) == 0, "block_n must be a power of two"
        self.block_n = block_n

    def prepare(self, meta: AttentionMetadata) -> TritonPlan:
        device = meta.slot_mapping.device
        has_skip = bool((meta.slot_mapping < 0).any())
        seq_idx: list[int] = []
        positions: list[int] = []
        for i, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
            seq_idx.extend([i] * q_len)
            positions.extend(range(ctx, ctx + q_len))
        return TritonPlan(
            valid=(meta.slot_mapping >= 0) if has_skip else None,
            token_seq=torch.tensor(seq_idx, dtype=torch.int32).to(device),
            token_pos=torch.tensor(positions, dtype=torch.int32).to(device),
        )

    def forward(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, plan: TritonPlan, layer: LayerAttention | None = None
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, plan.valid)
        k, v = as_cached(k, v, k_cache)  # the fresh rows the kernel reads from k/v, rounded like the cache
        num_tokens, num_heads, head_dim = q.shape  # q: [T, H, D]
        layer = layer or LayerAttention.plain(head_dim)
        kv_heads = k.shape[1]  # k, v: [T, KVH, D]
        assert num_heads % kv_heads == 0 and k_cache.stride() == v_cache.stride()
        out = torch.empty_like(q)  # [T, H, D]
        if num_tokens == 0:
            return out
        block_tables = meta.block_tables.contiguous()  # [B, max_blocks] int32
        _paged_attention_kernel[(num_tokens, num_heads)](
            q, k, v, k_cache, v_cache, out,
            plan.token_seq, plan.token_pos, meta.query_start_loc, meta.context_lens, block_tables,
            *q.stride(), *k.stride(), *v.stride(), *k_cache.stride(), *out.stride(),
            block_tables.stride(0),
            layer.scale, meta.block_size, num_heads // kv_heads, layer.window or 0, layer.softcap or 1.0, head_dim,
            D=triton.next_power_of_2(head_dim), BLOCK_N=self.block_n, SOFTCAP=layer.softcap is not None,
        )
        return out
