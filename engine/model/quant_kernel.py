"""The GGUF block kernel: y = x · dequant(W)ᵀ on Q4_0 / Q4_1 / Q5_0 / Q8_0 blocks and the
k-quants Q3_K / Q4_K / Q5_K / Q6_K (Q3_K_M, Q4_K_M and Q5_K_M files), in C++ (csrc/).

fp32 activations, weights dequantized inside the kernel (exactly as the gguf package does),
fp32 accumulation, threads over output rows. A decode step reads ~0.6 byte per weight (Q4_1)
instead of 4 (fp32), plus 0.25 for each Q4 block's scale pair in fp32 (`block_scales`): at one
row a Q4 block costs more in instructions than in memory traffic, and the fp32 pairs spare it
two fp16 conversions and their broadcasts. Q5_0 runs only that way (its pair is (d, -16 d)).
The k-quants run only repacked (`repack`: U4, U8, I8, 32 weights a block, with their exact
pairs (d sc, -dmin m) per 32, or (d sc) per 16), in layouts that dequantize in fewer
instructions than the stored ones; `matmul` and `dequantize` repack a k-quant first. Each
weight is still what gguf's dequantize computes, bit for bit.

One build holds three code paths, picked per call: "avx512", "avx2" (+FMA) and "portable";
`best_isa()` takes the best this CPU has (engine/cpu.py). Compiled at first use with -O3 only
(the ISA-specific functions carry target pragmas; -march=native would make the portable path
use instructions another CPU sharing the extensions directory lacks).

`matmul_q8` (weight_format "gguf-q8") is the same product with x quantized to int8 per
32-value block first, as llama.cpp does, then integer block dot products (AVX2 maddubs): fewer
instructions per weight, slightly different numerics. It has a portable and an AVX2 body; the
"avx512" path runs the AVX2 one. It runs Q4_0, Q4_1 and Q8_0 (`Q8_TYPES`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

import torch

from engine.cpp_build import KernelLoader, build_extension
from engine.cpu import cpu_info, kernel_isa, kernel_isa_supported

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = [_CSRC / "quant_matmul.cpp", *(_CSRC / h for h in ("quant_matmul_impl.h", "q8_matmul_impl.h", "decode_layer_impl.h"))]

class QType(NamedTuple):
    id: int  # ggml's type id (gguf.GGMLQuantizationType)
    bytes: int  # of one block
    weights: int  # in one block: 32, or a k-quant's super-block of 256


KERNEL_TYPES = {"Q4_0": QType(2, 18, 32), "Q4_1": QType(3, 20, 32), "Q5_0": QType(6, 22, 32),
                "Q8_0": QType(8, 34, 32), "Q3_K": QType(11, 110, 256), "Q4_K": QType(12, 144, 256),
                "Q5_K": QType(13, 176, 256), "Q6_K": QType(14, 210, 256),
                "U4": QType(100, 16, 32), "I8": QType(101, 32, 32), "U8": QType(102, 32, 32)}  # ours (repack)
REPACKED = {"Q3_K": "I8", "Q4_K": "U4", "Q5_K": "U8", "Q6_K": "I8"}  # what repack makes of a type
GGUF_TYPES = tuple(t for t in KERNEL_TYPES if t not in REPACKED.values())  # the ones a GGUF file holds
Q8_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # what matmul_q8 runs
SCALES_ONLY = ("Q5_0", "U4", "I8", "U8")  # the kernel runs them only with their scales (made when a caller has none)
BLOCK = 32  # weights per scale pair (block_scales) and per int8 activation block
ISAS = {"portable": 0, "avx2": 1, "avx512": 2}


def _build() -> None:
    # torch rebuilds when the .cpp changes, not the headers it includes: key the build by all
    tag = hashlib.sha1(b"".join(p.read_bytes() for p in _SOURCES)).hexdigest()[:8]
    build_extension("stepwise_gguf_matmul", [_SOURCES[0]], [(tag, ["-O3", "-ffp-contract=fast"])],
                    "GGUF matmul kernel")


_KERNEL = KernelLoader(_build, lambda: torch.ops.stepwise_gguf, "GGUF matmul kernel")


def quant_kernel_available() -> bool:
    return _KERNEL.available()


def require_kernel() -> None:
    """Build the kernel now; raise RuntimeError with the compiler's complaint if it fails."""
    _KERNEL.get()


def isa_supported(isa: str) -> bool:
    """Whether this CPU can run the `isa` path of the kernel."""
    if isa not in ISAS:
        raise ValueError(f"unknown kernel path {isa!r}; choose from {tuple(ISAS)}")
    return kernel_isa_supported(isa)


def best_isa() -> str:
    return kernel_isa()


def _isa_id(isa: str | None) -> int:
    isa = isa or best_isa()
    if not isa_supported(isa):
        raise ValueError(f"this CPU ({cpu_info().describe()}) cannot run the {isa!r} kernel path")
    return ISAS[isa]


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: str, isa: str | None = None,
           scales: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, K] float32, blocks: [N, K/block weights * block bytes] uint8 -> [T, N] float32.
    scales: the blocks' block_scales, which spare the kernel two fp16 conversions per Q4 block
    (and which the SCALES_ONLY types need: made here when not given; a k-quant is repacked here)."""
    blocks, qtype, scales = _runnable(blocks, qtype, scales)
    return _product("matmul", x, blocks, qtype, isa, _needed_scales(blocks, qtype, scales))


def dequantize(blocks: torch.Tensor, qtype: str, isa: str | None = None,
               scales: torch.Tensor | None = None) -> torch.Tensor:
    """blocks: [N, K/block weights * block bytes] uint8 -> [N, K] float32, equal to gguf's dequantize."""
    blocks, qtype, scales = _runnable(blocks, qtype, scales)
    t = KERNEL_TYPES[qtype]
    k = blocks.shape[1] // t.bytes * t.weights
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    _KERNEL.get().dequantize(blocks, t.id, k, _isa_id(isa), out, _needed_scales(blocks, qtype, scales))
    return out


def _runnable(blocks: torch.Tensor, qtype: str, scales: torch.Tensor | None) -> tuple[torch.Tensor, str, torch.Tensor | None]:
    """A k-quant repacked, keeping the caller's scales where given (they are its block_scales)."""
    if qtype not in REPACKED:
        return blocks, qtype, scales
    blocks, qtype, own = repack(blocks, qtype)
    return blocks, qtype, own if scales is None else scales


def _needed_scales(blocks: torch.Tensor, qtype: str, scales: torch.Tensor | None) -> torch.Tensor | None:
    """`scales`, or the blocks' own where the type runs only with them (SCALES_ONLY)."""
    return block_scales(blocks, qtype) if scales is None and qtype in SCALES_ONLY else scales


def repack(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, str, torch.Tensor | None]:
    """(blocks, type, scales) to run: a k-quant's codes laid out as the kernel dequantizes
    them cheapest, with its block_scales; other types as they are (scales None).

    Q4_K -> U4: each 32-weight slice's nibbles as Q4_0 orders them (byte j: weights j and j + 16),
    16 bytes, no header: dequantized as Q4_1 with fp32 pairs (~1.35x faster at one row than
    Q4_K's stored layout was, whose slices take every other nibble). Q6_K -> I8: the codes q - 32 as int8, one byte
    a weight instead of 0.82, dequantized as Q8_0 with a scale per 16 (~2.2x faster than
    assembling 4 + 2 bits). Q5_K -> U8: its 5-bit codes a byte each, with Q4_K's pairs; Q3_K ->
    I8: its codes (2 low bits, minus 4 where the high-bit mask is clear), with its scales per 16
    (the kernel runs every k-quant only so). Every weight stays what gguf's dequantize makes of the file."""
    if qtype not in REPACKED:
        return blocks, qtype, None
    scales, n = block_scales(blocks, qtype), blocks.shape[0]
    if qtype in ("Q4_K", "Q5_K"):  # the fp16 d, dmin and 12 bytes of scales, [Q5_K: 32 bytes of fifth bits,] nibbles
        b = blocks.view(n, -1, KERNEL_TYPES[qtype].bytes)
        qs = b[..., -128:].reshape(n, -1, 4, 32)  # chunk c: slice 2c low nibbles, 2c + 1 high
        codes = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, -1, 32)  # [N, K/32, 32], slices in order
        if qtype == "Q4_K":
            return (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, -1).contiguous(), "U4", scales
        qh = b[..., 16:48].reshape(n, -1, 1, 32)  # bit j of byte l: weight l of the super-block's slice j
        fifth = (qh >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1  # [N, S, 8, 32]
        return (codes.view(n, -1, 8, 32) | (fifth << 4)).reshape(n, -1).contiguous(), "U8", scales
    if qtype == "Q3_K":  # 32 bytes of high-bit mask, 64 of 2-bit low parts (4 runs of 32 a byte, per 128 weights)
        b = blocks.view(n, -1, 110)
        low = torch.stack([(b[..., 32:96].reshape(n, -1, 2, 32) >> (2 * i)) & 3 for i in range(4)], dim=3)
        mask = torch.stack([(b[..., :32] >> i) & 1 for i in range(8)], dim=2)  # [N, S, 8 runs of 32, l]
        codes = low.reshape(n, -1, 8, 32).to(torch.int16) - ((mask ^ 1) << 2).to(torch.int16)
        return codes.to(torch.int8).view(torch.uint8).reshape(n, -1).contiguous(), "I8", scales
    b = blocks.view(n, -1, 210)  # Q6_K, per 128 weights: 64 bytes of 4-bit low parts, 32 of 2-bit high parts
    ql = b[..., :128].reshape(n, -1, 2, 2, 32)  # [N, S, half, bytes l or l + 32, l]
    qh = b[..., 128:192].reshape(n, -1, 2, 32)  # [N, S, half, l]: 4 weights' high parts a byte
    low = torch.stack([ql[:, :, :, 0] & 15, ql[:, :, :, 1] & 15, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4], dim=3)
    high = torch.stack([(qh >> (2 * i)) & 3 for i in range(4)], dim=3)  # [N, S, half, 4 runs of 32, l]
    codes = (low | (high << 4)).to(torch.int16) - 32
    return codes.to(torch.int8).view(torch.uint8).reshape(n, -1).contiguous(), "I8", scales


def block_scales(blocks: torch.Tensor, qtype: str) -> torch.Tensor | None:
    """[N, K/32, 2] float32 per 32 weights, so that every weight is q * s0 + s1 (exact: see
    csrc/quant_matmul_impl.h): (d, m) for Q4_1, (d, -8 d) for Q4_0, (d, -16 d) for Q5_0,
    (d sc, -dmin m) for Q4_K; for Q6_K the scales d sc of the slice's two 16-weight halves (w = (q - 32) s).
    Q5_K's are Q4_K's. None for Q8_0, whose kernel is bound by memory, not by converting its
    scale. U4, I8 and U8 keep the scales repack made: their blocks hold none."""
    if qtype == "Q8_0":
        return None
    if qtype in REPACKED.values():
        raise ValueError(f"{qtype} blocks hold codes only: their scales come from repack")
    t = KERNEL_TYPES[qtype]
    b = blocks.view(blocks.shape[0], -1, t.bytes)  # [N, blocks, block bytes]

    def half(lo: int) -> torch.Tensor:  # [N, blocks, 1] fp16 at byte lo, as fp32 (exact)
        return b[..., lo : lo + 2].contiguous().view(torch.float16).float()

    if qtype in ("Q4_K", "Q5_K"):  # 8 six-bit scales and mins in 12 bytes (gguf's Q4_K.get_scale_min)
        s = b[..., 4:16].to(torch.int32)
        lo, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
        sc = torch.cat([lo & 63, (top & 15) | ((lo >> 2) & 48)], dim=-1)  # [N, blocks, 8]
        mn = torch.cat([mid & 63, (top >> 4) | ((mid >> 2) & 48)], dim=-1)
        pairs = torch.stack([half(0) * sc.float(), -(half(2) * mn.float())], dim=-1)  # [N, blocks, 8, 2]
    elif qtype == "Q6_K":  # 16 int8 scales, fp16 d last
        pairs = half(208) * b[..., 192:208].contiguous().view(torch.int8).float()  # [N, blocks, 16]
    elif qtype == "Q3_K":  # 16 six-bit scales (minus 32) in 12 bytes: low nibbles, then 2-bit high parts; fp16 d last
        s = b[..., 96:108]
        low = torch.cat([s[..., :8] & 15, s[..., :8] >> 4], dim=-1)  # [N, blocks, 16]
        high = torch.cat([(s[..., 8:12] >> (2 * i)) & 3 for i in range(4)], dim=-1)
        pairs = half(108) * ((low | (high << 4)).to(torch.int32) - 32).float()
    else:
        d = half(0)
        second = {"Q4_1": lambda: half(2), "Q4_0": lambda: -8 * d, "Q5_0": lambda: -16 * d}[qtype]()
        pairs = torch.cat([d, second], dim=-1)
    return pairs.reshape(blocks.shape[0], -1, 2).contiguous()


def matmul_q8(x: torch.Tensor, blocks: torch.Tensor, qtype: str, isa: str | None = None) -> torch.Tensor:
    """As matmul, with x quantized to int8 per 32-block inside the call (see quantize_q8)."""
    return _product("matmul_q8", x, blocks, qtype, isa)


def _product(op: str, x: torch.Tensor, blocks: torch.Tensor, qtype: str, isa: str | None,
             *scales: torch.Tensor | None) -> torch.Tensor:
    """The kernel op `op` (matmul or matmul_q8): x [T, K] float32 · dequant(blocks)ᵀ -> [T, N] float32."""
    t = KERNEL_TYPES[qtype]
    k = blocks.shape[1] // t.bytes * t.weights
    out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    getattr(_KERNEL.get(), op)(x if x.stride(-1) == 1 else x.contiguous(), blocks, t.id, k, _isa_id(isa), out,
                               *scales)
    return out


def quantize_q8(x: torch.Tensor, isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, K] float32 -> codes [T, K] int8, scales d [T, K/32], d * sum(codes) [T, K/32]:
    what matmul_q8 computes on; d = max|x| / 127 per block, codes = round(x / d)."""
    t, k = x.shape
    q = torch.empty(t, k, dtype=torch.int8)
    d, s = torch.empty(t, k // BLOCK), torch.empty(t, k // BLOCK)
    _KERNEL.get().quantize_q8(x if x.stride(-1) == 1 else x.contiguous(), _isa_id(isa), q, d, s)
    return q, d, s
