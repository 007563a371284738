// y[T, N] = x[T, K] . dequant(W)[N, K]^T on GGUF blocks (Q4_0, Q4_1, Q5_0, Q8_0, and U4 / I8 / U8, the
// forms the k-quants are repacked into at load), fp32 activations
// and fp32 accumulation, plus the dequantization itself; and the same product with x quantized
// to int8 per 32-block (q8_matmul_impl.h). Built at first use by engine/model/quant_kernel.py;
// registers torch.ops.stepwise_gguf.{matmul,dequantize,quantize_q8,matmul_q8}, the fused layer
// halves attn_in / attn_out_mlp (decode_layer_impl.h) that run a layer's work around attention
// in two calls, and `layers`, every layer of a step in one call around the CPU attention kernel
// (on GGUF blocks, or on oneDNN-prepacked dense weights for steps of many rows).
//
// One build serves every x86-64 CPU: the kernel body (quant_matmul_impl.h) is compiled three
// times, for AVX-512, for AVX2+FMA (target pragmas, never -march=native) and portably (the
// compiler's baseline), and the caller picks one with `isa` from the CPU's features
// (0 = portable, 1 = AVX2, 2 = AVX-512), so a test can force any path the CPU can run.
// Work is split over output rows with at::parallel_for (torch's intra-op threads).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/silu.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// the int8 kernel's small helpers: GCC otherwise stops inlining them once the tile grows
#define STEPWISE_INLINE inline __attribute__((always_inline))

// ggml's type ids
constexpr int Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8;
// Ours (engine/model/quant_kernel.py, repack): the k-quants' codes laid out for the cheapest
// dequantization, with their exact fp32 scales. U4: 16 bytes of nibbles per 32 weights as Q4_0
// lays them out, no header, w = q s0 + s1 (Q4_K's pairs); I8: 32 int8 codes q - 32 per 32
// weights, w = c s, a scale per 16 (Q6_K's); U8: 32 uint8 codes per 32 weights, w = q s0 + s1
// (Q5_K's pairs; Q5_K runs only so).
constexpr int U4 = 100, I8 = 101, U8 = 102;
constexpr int PANEL = 24;  // weight rows dequantized at a time (24 x K fp32: 54 KiB at K = 576), 4 x 6
constexpr int DIRECT_MAX_ROWS = 3;  // up to this many rows of x, no panel (see direct())
constexpr int PREFETCH_GROUPS = 2;  // direct(): how many row groups ahead to prefetch
constexpr int Q8_GROUP = 16;  // q8_rows(): weight rows per group (also the threads' grain)

// Every block holds 32 weights.
constexpr int64_t BLOCK_WEIGHTS = 32;
constexpr int64_t block_bytes(int qt) {
  return qt == Q4_0 ? 18 : qt == Q4_1 ? 20 : qt == Q5_0 ? 22 : qt == Q8_0 ? 34 : qt == U4 ? 16 : 32;  // I8, U8
}
// The types whose weights the kernel takes only through their fp32 scale pairs (Job::scales):
// Q5_0 (d, -16 d), U4 and U8 (d sc, -dmin m) per 32 weights, I8 (d sc) per 16, two to a 32.
constexpr bool scales_only(int qt) { return qt == Q5_0 || qt == U4 || qt == I8 || qt == U8; }
bool known_type(int64_t qt) { return qt == Q4_0 || qt == Q4_1 || qt == Q8_0 || scales_only(int(qt)); }
// columns of x packed k-major (matmul_rows): T rounded up to 16, a whole number of vectors on every path
constexpr int64_t packed_rows(int64_t T) { return (T + 15) / 16 * 16; }
// floats of a thread's scratch for a panel product: packed x, then one dequantized panel
constexpr int64_t panel_scratch(int64_t T, int64_t K) { return K * packed_rows(T) + PANEL * K; }

struct Job {
  const float* x;
  int64_t ldx, T;
  const uint8_t* blocks;
  int64_t N, row_bytes, K;
  float* out;
  int64_t ldo;
  int qtype;
  const float* scales;  // [N, K/32, 2] fp32 scale pairs (quant_matmul_impl.h): Q4 optional, scales_only types always
};

// The int8-activation product: x already quantized (q8_matmul_impl.h), one row of codes per row of x.
struct Q8Job {
  const int8_t* xq;  // [T, K] codes
  const float* xd;   // [T, K/32] block scales d
  const float* xs;   // [T, K/32] d * sum(codes), for Q4_1's min term
  int64_t T;
  const uint8_t* blocks;
  int64_t N, row_bytes, K;
  float* out;
  int64_t ldo;
  int qtype;
};

namespace portable {
constexpr int SW = 4;
#define STEPWISE_SW 4
#include "quant_matmul_impl.h"
#include "q8_matmul_impl.h"
#undef STEPWISE_SW
}  // namespace portable

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define STEPWISE_X86 1
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
constexpr int SW = 8;
#define STEPWISE_SW 8
#include "quant_matmul_impl.h"
#include "q8_matmul_impl.h"
#undef STEPWISE_SW
}  // namespace avx2
#ifdef __clang__
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif
namespace avx512 {
constexpr int SW = 16;
#define STEPWISE_SW 16
#include "quant_matmul_impl.h"
#undef STEPWISE_SW
}  // namespace avx512
#ifdef __clang__
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

void check_blocks(const at::Tensor& blocks, int64_t qtype, int64_t K, int64_t isa) {
  TORCH_CHECK(known_type(qtype), "stepwise_gguf: unsupported ggml type ", qtype,
              " (Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, U4 = 100, I8 = 101, U8 = 102; the k-quants run repacked)");
  const int64_t bw = BLOCK_WEIGHTS;
  TORCH_CHECK(K > 0 && K % bw == 0, "stepwise_gguf: K = ", K, " is not a multiple of the block size ", bw);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(), "stepwise_gguf: blocks must be a contiguous uint8 CPU tensor [N, row bytes]");
  TORCH_CHECK(blocks.size(1) == K / bw * block_bytes(int(qtype)), "stepwise_gguf: rows of ", blocks.size(1),
              " bytes do not hold K = ", K, " weights of type ", qtype);
#ifdef STEPWISE_X86
  TORCH_CHECK(isa >= 0 && isa <= 2, "stepwise_gguf: isa must be 0 (portable), 1 (avx2) or 2 (avx512)");
#else
  TORCH_CHECK(isa == 0, "stepwise_gguf: only the portable path exists on this architecture");
#endif
}

// blocks' fp32 scale pairs, or nullptr: [N, K/32, 2] float32 for a Q4 type (Q8_0 has none; the
// scales_only types must have them)
const float* check_scales(const c10::optional<at::Tensor>& scales, int64_t qtype, int64_t N, int64_t K) {
  TORCH_CHECK(scales.has_value() || !scales_only(int(qtype)), "stepwise_gguf: blocks of type ", qtype,
              " run only with their fp32 scales (quant_kernel.block_scales)");
  if (!scales.has_value()) return nullptr;
  TORCH_CHECK(qtype != Q8_0, "stepwise_gguf: Q8_0 blocks take no fp32 scales");
  TORCH_CHECK(scales->device().is_cpu() && scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                  scales->numel() == N * (K / 32) * 2, "stepwise_gguf: scales must be contiguous float32 [N, K/32, 2] = [",
              N, ", ", K / 32, ", 2]");
  return scales->data_ptr<float>();
}

// The product of a checked job, over torch's intra-op threads by panels of output rows.
void run_matmul(const Job& job, int64_t isa) {
  const int64_t num_panels = (job.N + PANEL - 1) / PANEL;
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    // kept per thread: a step calls this for every projection, and a fresh buffer of this
    // size would be a fresh mapping (and its page faults) each time
    thread_local std::vector<float> scratch;
    if (job.T > DIRECT_MAX_ROWS) scratch.resize(std::max<size_t>(scratch.size(), panel_scratch(job.T, job.K)));
    const int64_t n0 = p0 * PANEL, n1 = std::min(job.N, p1 * PANEL);
#ifdef STEPWISE_X86
    if (isa == 2) return avx512::matmul(job, n0, n1, scratch.data());
    if (isa == 1) return avx2::matmul(job, n0, n1, scratch.data());
#endif
    portable::matmul(job, n0, n1, scratch.data());
  });
}

// x [T, K] float32 (rows may be strided, K contiguous), blocks [N, K/32 * block bytes] uint8,
// out [T, N] float32 (written; K-contiguous rows).
void matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t K, int64_t isa, const at::Tensor& out,
            const c10::optional<at::Tensor>& scales) {
  check_blocks(blocks, qtype, K, isa);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K &&
                  x.stride(1) == 1, "stepwise_gguf.matmul: x must be float32 [T, K] with contiguous rows");
  const int64_t T = x.size(0), N = blocks.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == T && out.size(1) == N &&
                  out.stride(1) == 1, "stepwise_gguf.matmul: out must be float32 [T, N] with contiguous rows");
  if (T == 0 || N == 0) return;
  run_matmul(Job{x.data_ptr<float>(), x.stride(0), T, blocks.data_ptr<uint8_t>(), N, blocks.size(1), K,
                 out.data_ptr<float>(), out.stride(0), int(qtype), check_scales(scales, qtype, N, K)}, isa);
}

// blocks [N, row bytes] (scales [N, K/32, 2] or none) -> out [N, K] float32 (written, contiguous).
void dequantize(const at::Tensor& blocks, int64_t qtype, int64_t K, int64_t isa, const at::Tensor& out,
                const c10::optional<at::Tensor>& scales) {
  check_blocks(blocks, qtype, K, isa);
  const int64_t N = blocks.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == N &&
                  out.size(1) == K, "stepwise_gguf.dequantize: out must be contiguous float32 [N, K]");
  const Job job{nullptr, 0, 0, blocks.data_ptr<uint8_t>(), N, blocks.size(1), K, out.data_ptr<float>(), K, int(qtype),
                check_scales(scales, qtype, N, K)};
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
#ifdef STEPWISE_X86
    if (isa == 2) return avx512::dequant(job, n0, n1);
    if (isa == 1) return avx2::dequant(job, n0, n1);
#endif
    portable::dequant(job, n0, n1);
  });
}

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K &&
                  x.stride(1) == 1, "stepwise_gguf.", op, ": x must be float32 [T, K] with contiguous rows");
}

// x [T, K] rows quantized per 32-block into the caller's buffers (AVX-512 runs the AVX2 body).
void quantize_rows(const float* x, int64_t ldx, int64_t T, int64_t K, int64_t isa, int8_t* q, float* d, float* s) {
  const int64_t nb = K / 32;
  for (int64_t t = 0; t < T; ++t) {
#ifdef STEPWISE_X86
    if (isa >= 1) {
      avx2::quantize_row(x + t * ldx, K, q + t * K, d + t * nb, s + t * nb);
      continue;
    }
#endif
    portable::quantize_row(x + t * ldx, K, q + t * K, d + t * nb, s + t * nb);
  }
}

// x [T, K] float32 -> q [T, K] int8, d [T, K/32], s [T, K/32] float32 (all written, contiguous).
void quantize_q8(const at::Tensor& x, int64_t isa, const at::Tensor& q, const at::Tensor& d, const at::Tensor& s) {
  const int64_t K = x.size(-1);
  TORCH_CHECK(K > 0 && K % 32 == 0, "stepwise_gguf.quantize_q8: K = ", K, " is not a multiple of the block size 32");
  check_x(x, K, "quantize_q8");
  TORCH_CHECK(isa >= 0 && isa <= 2, "stepwise_gguf.quantize_q8: isa must be 0, 1 or 2");
  const int64_t T = x.size(0);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.numel() == T * K && d.scalar_type() == at::kFloat &&
                  d.is_contiguous() && d.numel() == T * K / 32 && s.scalar_type() == at::kFloat &&
                  s.is_contiguous() && s.numel() == T * K / 32,
              "stepwise_gguf.quantize_q8: q must be contiguous int8 [T, K], d and s float32 [T, K/32]");
  quantize_rows(x.data_ptr<float>(), x.stride(0), T, K, isa, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                s.data_ptr<float>());
}

// As matmul, with x quantized to int8 per 32-block once per call, then integer block products.
void matmul_q8(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t K, int64_t isa, const at::Tensor& out) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0, "stepwise_gguf.matmul_q8: ggml type ", qtype,
              " has no int8 kernel (Q4_0, Q4_1, Q8_0 do)");
  check_blocks(blocks, qtype, K, isa);
  check_x(x, K, "matmul_q8");
  const int64_t T = x.size(0), N = blocks.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == T && out.size(1) == N &&
                  out.stride(1) == 1, "stepwise_gguf.matmul_q8: out must be float32 [T, N] with contiguous rows");
  if (T == 0 || N == 0) return;
  std::vector<int8_t> xq(T * K);
  std::vector<float> xd(T * K / 32), xs(T * K / 32);
  quantize_rows(x.data_ptr<float>(), x.stride(0), T, K, isa, xq.data(), xd.data(), xs.data());
  const Q8Job job{xq.data(), xd.data(), xs.data(), T, blocks.data_ptr<uint8_t>(), N, blocks.size(1), K,
                  out.data_ptr<float>(), out.stride(0), int(qtype)};
  const int64_t num_groups = (N + Q8_GROUP - 1) / Q8_GROUP;
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * Q8_GROUP, n1 = std::min(N, g1 * Q8_GROUP);
#ifdef STEPWISE_X86
    if (isa >= 1) return avx2::q8_matmul(job, n0, n1);
#endif
    portable::q8_matmul(job, n0, n1);
  });
}

#include "decode_layer_impl.h"

}  // namespace

TORCH_LIBRARY(stepwise_gguf, m) {
  m.def("matmul(Tensor x, Tensor blocks, int qtype, int K, int isa, Tensor(a!) out, Tensor? scales=None) -> ()");
  m.def("dequantize(Tensor blocks, int qtype, int K, int isa, Tensor(a!) out, Tensor? scales=None) -> ()");
  m.impl("matmul", c10::DispatchKey::CPU, TORCH_FN(matmul));
  m.impl("dequantize", c10::DispatchKey::CPU, TORCH_FN(dequantize));
  m.def("quantize_q8(Tensor x, int isa, Tensor(a!) q, Tensor(b!) d, Tensor(c!) s) -> ()");
  m.def("matmul_q8(Tensor x, Tensor blocks, int qtype, int K, int isa, Tensor(a!) out) -> ()");
  m.impl("quantize_q8", c10::DispatchKey::CPU, TORCH_FN(quantize_q8));
  m.impl("matmul_q8", c10::DispatchKey::CPU, TORCH_FN(matmul_q8));
  m.def("attn_in(Tensor h, Tensor norm_w, float eps, Tensor blocks, int qtype, Tensor? bias, Tensor cos, Tensor sin, "
        "int heads, int kv_heads, int head_dim, int isa, Tensor(a!) qkv, Tensor? scales=None) -> ()");
  m.def("attn_out_mlp(Tensor(a!) h, Tensor attn, Tensor o_blocks, int o_qtype, Tensor? o_bias, Tensor norm_w, "
        "float eps, Tensor gu_blocks, int gu_qtype, Tensor? gu_bias, Tensor down_blocks, int down_qtype, "
        "Tensor? down_bias, int isa, Tensor?[] scales) -> ()");
  m.def("layers(Tensor(a!) h, Tensor[] norms, Tensor[] weights, int[] types, int[] parts, Tensor?[] biases, "
        "Tensor[] cos, Tensor[] sin, int heads, int kv_heads, int head_dim, float eps, int isa, Tensor(b!) kv, "
        "Tensor slot_mapping, Tensor tiles, Tensor block_tables, float[] scale, int[] window, float[] softcap, "
        "Tensor?[] block_scales, Tensor?[] extra_norms, int activation) -> ()");
  m.impl("attn_in", c10::DispatchKey::CPU, TORCH_FN(attn_in));
  m.impl("layers", c10::DispatchKey::CPU, TORCH_FN(layers));
  m.impl("layers", c10::DispatchKey::MkldnnCPU, TORCH_FN(layers));  // dense weights are oneDNN tensors
  m.impl("attn_out_mlp", c10::DispatchKey::CPU, TORCH_FN(attn_out_mlp));
}
