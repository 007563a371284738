// The body of the GGUF block kernels for one instruction set. quant_matmul.cpp includes this
// file once per ISA, each time inside its own namespace, under a target pragma, with SW (fp32
// lanes per vector) defined: 16 for AVX-512, 8 for AVX2+FMA, 4 for the portable build. The
// code is GCC/Clang vector extensions, so the compiler maps it onto the registers that target
// has (one zmm, one ymm, or an SSE2/scalar sequence).
//
// Block layouts (32 weights each, ggml's): Q4_0 = fp16 d, 16 bytes of nibbles, w = (q - 8) d;
// Q4_1 = fp16 d, fp16 m, 16 bytes of nibbles, w = q d + m; Q8_0 = fp16 d, 32 int8, w = q d.
// Nibble j of a block is the low half of byte j (weights 0..15), the high half is weight j+16.
// Every product q*d is exact in fp32 (at most 8 + 11 significant bits), so whether the
// compiler fuses "q*d + m" or not, a dequantized weight equals gguf's numpy dequantization.

using vf = float __attribute__((vector_size(SW * 4)));
using f16x = float __attribute__((vector_size(64)));  // 16 floats
using u8x16 = uint8_t __attribute__((vector_size(16)));
using i8x16 = int8_t __attribute__((vector_size(16)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float hsum(vf v) {
  float s = 0.f;
  for (int j = 0; j < SW; ++j) s += v[j];
  return s;
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

inline void store16(float* dst, f16x v) { std::memcpy(dst, &v, sizeof v); }

// One block (32 weights) -> dst[0..31].
template <int QT>
inline void dequant_block(const uint8_t* b, float* dst) {
  if constexpr (QT == Q8_0) {
    const float d = half(b);
    for (int h = 0; h < 2; ++h) {
      i8x16 q;
      std::memcpy(&q, b + 2 + 16 * h, 16);
      store16(dst + 16 * h, __builtin_convertvector(q, f16x) * d);
    }
  } else {
    const float d = half(b);
    u8x16 q;
    std::memcpy(&q, b + (QT == Q4_1 ? 4 : 2), 16);
    const f16x lo = __builtin_convertvector(q & 15, f16x), hi = __builtin_convertvector(q >> 4, f16x);
    if constexpr (QT == Q4_1) {
      const float m = half(b + 2);
      store16(dst, lo * d + m), store16(dst + 16, hi * d + m);
    } else {  // keep gguf's order exactly: (q - 8) * d
      store16(dst, (lo - 8.f) * d), store16(dst + 16, (hi - 8.f) * d);
    }
  }
}

template <int QT>
void dequant_rows(const uint8_t* blocks, int64_t row_bytes, int64_t K, float* out, int64_t n0, int64_t n1) {
  const int64_t nb = K / 32;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < nb; ++b) dequant_block<QT>(blocks + n * row_bytes + b * block_bytes(QT), out + n * K + b * 32);
}

// out[t, n] = x[t, :] . w[n, :] for MR rows of x and NR (dequantized, fp32) rows of w.
template <int MR, int NR>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo) {
  vf acc[MR][NR] = {};
  for (int64_t k = 0; k < K; k += SW) {
    vf wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const vf xv = load(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = hsum(acc[i][j]);
}

// All T rows of x against NR panel rows: tiles of 4 rows, then the 1-3 left over.
template <int NR>
inline void rows_x_panel(const float* x, int64_t ldx, int64_t T, const float* w, int64_t K, float* out, int64_t ldo) {
  int64_t t = 0;
  for (; t + 4 <= T; t += 4) micro<4, NR>(x + t * ldx, ldx, w, K, out + t * ldo, ldo);
  switch (T - t) {
    case 3: micro<3, NR>(x + t * ldx, ldx, w, K, out + t * ldo, ldo); break;
    case 2: micro<2, NR>(x + t * ldx, ldx, w, K, out + t * ldo, ldo); break;
    case 1: micro<1, NR>(x + t * ldx, ldx, w, K, out + t * ldo, ldo); break;
    default: break;
  }
}

// Output rows [n0, n1) of y = x . dequant(W)^T. Panels of PANEL weight rows are dequantized
// into `panel` (fp32, stays in L1/L2) and multiplied by every row of x; the weight bytes are
// read from memory once per step whatever the row count.
template <int QT>
void matmul_rows(const float* x, int64_t ldx, int64_t T, const uint8_t* blocks, int64_t row_bytes, int64_t K,
                 float* out, int64_t ldo, int64_t n0, int64_t n1, float* panel) {
  for (int64_t p = n0; p < n1; p += PANEL) {
    const int64_t rows = std::min<int64_t>(PANEL, n1 - p);
    dequant_rows<QT>(blocks + p * row_bytes, row_bytes, K, panel, 0, rows);
    int64_t j = 0;
    for (; j + 2 <= rows; j += 2) rows_x_panel<2>(x, ldx, T, panel + j * K, K, out + p + j, ldo);
    if (j < rows) rows_x_panel<1>(x, ldx, T, panel + j * K, K, out + p + j, ldo);
  }
}

inline void matmul(const Job& a, int64_t n0, int64_t n1, float* panel) {
  switch (a.qtype) {
    case Q4_0: return matmul_rows<Q4_0>(a.x, a.ldx, a.T, a.blocks, a.row_bytes, a.K, a.out, a.ldo, n0, n1, panel);
    case Q4_1: return matmul_rows<Q4_1>(a.x, a.ldx, a.T, a.blocks, a.row_bytes, a.K, a.out, a.ldo, n0, n1, panel);
    default: return matmul_rows<Q8_0>(a.x, a.ldx, a.T, a.blocks, a.row_bytes, a.K, a.out, a.ldo, n0, n1, panel);
  }
}

inline void dequant(const Job& a, int64_t n0, int64_t n1) {
  switch (a.qtype) {
    case Q4_0: return dequant_rows<Q4_0>(a.blocks, a.row_bytes, a.K, a.out, n0, n1);
    case Q4_1: return dequant_rows<Q4_1>(a.blocks, a.row_bytes, a.K, a.out, n0, n1);
    default: return dequant_rows<Q8_0>(a.blocks, a.row_bytes, a.K, a.out, n0, n1);
  }
}
