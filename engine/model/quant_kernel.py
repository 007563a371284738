"""The GGUF block kernel: y = x · dequant(W)ᵀ on Q4_0 / Q4_1 / Q8_0 blocks, in C++ (csrc/).

fp32 activations, weights dequantized inside the kernel (exactly as the gguf package does),
fp32 accumulation, threads over output rows. A decode step reads ~0.6 byte per weight (Q4_1)
instead of 4 (fp32), plus 0.25 for each Q4 block's scale pair in fp32 (`block_scales`): at one
row a Q4 block costs more in instructions than in memory traffic, and the fp32 pairs spare it
two fp16 conversions and their broadcasts.

One build holds three code paths, picked per call: "avx512", "avx2" (+FMA) and "portable";
`best_isa()` takes the best this CPU has (engine/cpu.py). Compiled at first use with -O3 only
(the ISA-specific functions carry target pragmas; -march=native would make the portable path
use instructions another CPU sharing the extensions directory lacks).

`matmul_q8` (weight_format "gguf-q8") is the same product with x quantized to int8 per
32-value block first, as llama.cpp does, then integer block dot products (AVX2 maddubs): fewer
instructions per weight, slightly different numerics. It has a portable and an AVX2 body; the
"avx512" path runs the AVX2 one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from engine.cpp_build import KernelLoader, build_extension
from engine.cpu import cpu_info, kernel_isa, kernel_isa_supported

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = [_CSRC / "quant_matmul.cpp", *(_CSRC / h for h in ("quant_matmul_impl.h", "q8_matmul_impl.h", "decode_layer_impl.h"))]

# ggml type ids (gguf.GGMLQuantizationType) the kernel runs, with their block size in bytes
KERNEL_TYPES = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
BLOCK = 32  # weights per block
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
    """x: [T, K] float32, blocks: [N, K/32 * block bytes] uint8 -> [T, N] float32. scales: the
    blocks' block_scales (Q4 types), which spare the kernel two fp16 conversions per block."""
    return _product("matmul", x, blocks, qtype, isa, scales)


def dequantize(blocks: torch.Tensor, qtype: str, isa: str | None = None,
               scales: torch.Tensor | None = None) -> torch.Tensor:
    """blocks: [N, K/32 * block bytes] uint8 -> [N, K] float32, equal to gguf's dequantize."""
    type_id, nbytes = KERNEL_TYPES[qtype]
    k = blocks.shape[1] // nbytes * BLOCK
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    _KERNEL.get().dequantize(blocks, type_id, k, _isa_id(isa), out, scales)
    return out


def block_scales(blocks: torch.Tensor, qtype: str) -> torch.Tensor | None:
    """[N, K/32, 2] float32 per Q4 block: (d, m) for Q4_1, (d, -8 d) for Q4_0, so that every weight
    is q * s0 + s1 (exact: see csrc/quant_matmul_impl.h); None for Q8_0, whose kernel is bound by
    memory, not by converting its scale."""
    if qtype == "Q8_0":
        return None
    nbytes = KERNEL_TYPES[qtype][1]
    b = blocks.view(blocks.shape[0], -1, nbytes)  # [N, K/32, block bytes]
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [N, K/32, 1], exact
    second = b[..., 2:4].contiguous().view(torch.float16).float() if qtype == "Q4_1" else -8 * d
    return torch.cat([d, second], dim=-1).contiguous()


def matmul_q8(x: torch.Tensor, blocks: torch.Tensor, qtype: str, isa: str | None = None) -> torch.Tensor:
    """As matmul, with x quantized to int8 per 32-block inside the call (see quantize_q8)."""
    return _product("matmul_q8", x, blocks, qtype, isa)


def _product(op: str, x: torch.Tensor, blocks: torch.Tensor, qtype: str, isa: str | None,
             *scales: torch.Tensor | None) -> torch.Tensor:
    """The kernel op `op` (matmul or matmul_q8): x [T, K] float32 · dequant(blocks)ᵀ -> [T, N] float32."""
    type_id, nbytes = KERNEL_TYPES[qtype]
    k = blocks.shape[1] // nbytes * BLOCK
    out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    getattr(_KERNEL.get(), op)(x if x.stride(-1) == 1 else x.contiguous(), blocks, type_id, k, _isa_id(isa), out,
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
