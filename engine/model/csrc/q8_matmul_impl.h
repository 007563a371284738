// The int8-activation GGUF kernel body for one instruction set (weight_format "gguf-q8").
// quant_matmul.cpp includes it right after quant_matmul_impl.h, inside the portable and the
// avx2 namespaces (whose `half`, `vf`, `hsum` and SW it uses); AVX-512 CPUs run the AVX2 body.
//
// Each row of x is quantized per 32-value block, as llama.cpp's Q8_0/Q8_1 do: d = max|x| / 127,
// q = round(x / d) (half to even; q = 0 where d = 0), s = d * sum(q). A weight block then
// takes one integer dot product (exact) and one fp32 multiply-add:
//   Q8_0, Q4_0:  sum_j x_j w_j ~ (dx dw) * sum_j qx_j qw_j       (qw signed: int8, or nibble - 8)
//   Q4_1:        sum_j x_j w_j ~ (dx dw) * sum_j qx_j qw_j + m s  (qw the unsigned nibble, w = qw dw + m)
// The only rounding beyond the fp32 kernel's is x's quantization (|error| <= d / 2 per value).

#if STEPWISE_SW == 8
// 32 codes of one block in one register: activations and Q8_0 / Q4_0 signed, Q4_1 unsigned.
struct Codes {
  __m256i v;
};
using Acc = vf;  // 8 partial sums; their total is taken once, at the end

STEPWISE_INLINE Codes x_codes(const int8_t* p) { return {_mm256_loadu_si256((const __m256i*)p)}; }

// 16 bytes of nibbles -> 32 bytes in weight order (low halves are weights 0..15, high 16..31).
STEPWISE_INLINE __m256i nibbles(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128((const __m128i*)p);
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

template <int QT>
STEPWISE_INLINE Codes w_codes(const uint8_t* b) {
  if constexpr (QT == Q8_0) return {_mm256_loadu_si256((const __m256i*)(b + 2))};
  if constexpr (QT == Q4_0) return {_mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8))};
  return {nibbles(b + 4)};
}

// 8 int32 partial sums of u_j * s_j, u unsigned, s signed. maddubs adds pairs into int16 with
// saturation, which is never reached: |u s| <= 128 * 127, so a pair stays within +-32512.
STEPWISE_INLINE __m256i dot_us(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

template <int QT>
STEPWISE_INLINE void madd_block(Acc& acc, const Codes& w, const Codes& x, float scale) {
  // signed x signed: |w| (unsigned; |-128| = 128) times x carrying w's sign
  const __m256i sums = QT == Q4_1 ? dot_us(w.v, x.v)
                                  : dot_us(_mm256_sign_epi8(w.v, w.v), _mm256_sign_epi8(x.v, w.v));
  acc = (vf)_mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale), (__m256)acc);
}

inline float total(Acc acc) { return hsum(acc); }

// One block of 32 activations -> 32 codes; returns sum(q). x / d with IEEE division and
// round-half-even, so the codes equal torch's round(x / d) bit for bit.
inline int quantize_block(const float* x, float d, int8_t* q) {
  if (d == 0.f) {
    std::memset(q, 0, 32);
    return 0;
  }
  const __m256 dv = _mm256_set1_ps(d);
  __m256i i[4];
  for (int h = 0; h < 4; ++h)
    i[h] = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + 8 * h), dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // packs interleave 128-bit lanes: dwords come out as i0 i1 i2 i3 (low halves), then the high halves
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  int s[8];
  _mm256_storeu_si256((__m256i*)s, s4);
  return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

inline float block_absmax(const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
  for (int h = 1; h < 4; ++h) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * h)));
  float v[8];
  _mm256_storeu_ps(v, m);
  return *std::max_element(v, v + 8);
}
// The scales of 4 consecutive blocks, as fp32, so that one multiply makes 4 blocks' dx dw (and
// Q4_1's 4 m s) instead of one fp16 conversion, multiply and broadcast per block.
// Weight side: Q4_1 [d0 m0 d1 m1 d2 m2 d3 m3]; Q4_0 / Q8_0 [d0 d1 d2 d3 0 0 0 0].
template <int QT>
STEPWISE_INLINE __m256 w_scales4(const uint8_t* p) {
  constexpr int64_t B = block_bytes(QT);
  if constexpr (QT == Q4_1) {
    int32_t h[4];
    for (int k = 0; k < 4; ++k) std::memcpy(&h[k], p + k * B, 4);
    return _mm256_cvtph_ps(_mm_setr_epi32(h[0], h[1], h[2], h[3]));
  } else {
    int16_t h[4];
    for (int k = 0; k < 4; ++k) std::memcpy(&h[k], p + k * B, 2);
    return _mm256_insertf128_ps(_mm256_setzero_ps(), _mm_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], 0, 0, 0, 0)), 0);
  }
}

// x side, lane for lane: Q4_1 [dx0 sx0 dx1 sx1 dx2 sx2 dx3 sx3]; the others [dx0 dx1 dx2 dx3 0 0 0 0].
template <int QT>
STEPWISE_INLINE __m256 x_scales4(const float* d, const float* s) {
  const __m128 dv = _mm_loadu_ps(d);
  if constexpr (QT == Q4_1) {
    const __m128 sv = _mm_loadu_ps(s);
    return _mm256_set_m128(_mm_unpackhi_ps(dv, sv), _mm_unpacklo_ps(dv, sv));
  } else {
    return _mm256_insertf128_ps(_mm256_setzero_ps(), dv, 0);
  }
}
#else
struct Codes {
  int8_t v[32];
};
using Acc = float;

STEPWISE_INLINE Codes x_codes(const int8_t* p) {
  Codes c;
  std::memcpy(c.v, p, 32);
  return c;
}

template <int QT>
STEPWISE_INLINE Codes w_codes(const uint8_t* b) {
  Codes c;
  if constexpr (QT == Q8_0) {
    std::memcpy(c.v, b + 2, 32);
  } else {
    const uint8_t* q = b + (QT == Q4_1 ? 4 : 2);
    const int zero = QT == Q4_1 ? 0 : 8;
    for (int j = 0; j < 16; ++j) c.v[j] = int8_t((q[j] & 15) - zero), c.v[j + 16] = int8_t((q[j] >> 4) - zero);
  }
  return c;
}

template <int QT>
STEPWISE_INLINE void madd_block(Acc& acc, const Codes& w, const Codes& x, float scale) {
  int32_t sum = 0;
  for (int j = 0; j < 32; ++j) sum += int32_t(w.v[j]) * int32_t(x.v[j]);
  acc += float(sum) * scale;
}

inline float total(Acc acc) { return acc; }

inline int quantize_block(const float* x, float d, int8_t* q) {
  int sum = 0;
  for (int j = 0; j < 32; ++j) {
    const int v = d == 0.f ? 0 : int(std::nearbyint(x[j] / d));
    q[j] = int8_t(std::clamp(v, -127, 127));
    sum += q[j];
  }
  return sum;
}

inline float block_absmax(const float* x) {
  float m = 0.f;
  for (int j = 0; j < 32; ++j) m = std::max(m, std::fabs(x[j]));
  return m;
}
#endif

// x row [K] -> q [K] codes, d [K/32] scales, s [K/32] = d * sum(q) per block.
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / 32; ++b) {
    d[b] = block_absmax(x + 32 * b) / 127.f;
    s[b] = d[b] * float(quantize_block(x + 32 * b, d[b], q + 32 * b));
  }
}

// out[t + i, n + j] for MR rows of x and NR weight rows: each weight block is unpacked once
// and used for all MR rows. The first tile over these weight rows (t = 0) reads them from
// memory and prefetches the run PREFETCH_GROUPS tiles ahead, as direct() does: an int8 block
// takes so few instructions that the hardware prefetcher alone falls behind (measured: the
// Q8_0 LM head ran at half the fp32 kernel's speed without it).
// Requests bytes [from, to) of the run at `ahead` (not past `end`), one cache line at a time.
STEPWISE_INLINE void prefetch(const uint8_t* ahead, const uint8_t* end, int64_t from, int64_t to) {
  for (int64_t off = from; off < to; off += 64)
    if (ahead + off < end) __builtin_prefetch(ahead + off, 0, 0);
}

template <int QT, int MR, int NR>
STEPWISE_INLINE void q8_tile(const Q8Job& a, int64_t t, int64_t n) {
  Acc acc[MR][NR] = {};
  float mins[MR][NR] = {};  // Q4_1: sum over blocks of m * s
  const int64_t nb = a.K / 32;
  const int64_t span = NR * a.row_bytes;
  const uint8_t* ahead = a.blocks + n * a.row_bytes + PREFETCH_GROUPS * span;
  const uint8_t* end = a.blocks + a.N * a.row_bytes;
  const bool first = t == 0;
  int64_t b = 0;
#if STEPWISE_SW == 8
  vf min4[MR][NR] = {};  // Q4_1: m * s of 4 blocks at a time in the odd lanes (the even lanes are not used)
  // one row of x only (decode): with more, the 4-block scales of every row cost registers the
  // per-block loop below keeps (measured slower at 16 rows)
  for (; MR == 1 && b + 4 <= nb; b += 4) {
    if (first) prefetch(ahead, end, b * span / nb, (b + 4) * span / nb);
    __m256 xs4[MR];
    for (int i = 0; i < MR; ++i) xs4[i] = x_scales4<QT>(a.xd + (t + i) * nb + b, a.xs + (t + i) * nb + b);
    for (int j = 0; j < NR; ++j) {
      const uint8_t* p = a.blocks + (n + j) * a.row_bytes + b * block_bytes(QT);
      const __m256 ws4 = w_scales4<QT>(p);
      alignas(32) float scale[MR][8];
      for (int i = 0; i < MR; ++i) {
        const __m256 prod = _mm256_mul_ps(ws4, xs4[i]);
        _mm256_store_ps(scale[i], prod);
        if constexpr (QT == Q4_1) min4[i][j] += (vf)prod;
      }
      for (int k = 0; k < 4; ++k) {
        const Codes w = w_codes<QT>(p + k * block_bytes(QT));
        for (int i = 0; i < MR; ++i)
          madd_block<QT>(acc[i][j], w, x_codes(a.xq + (t + i) * a.K + 32 * (b + k)), scale[i][QT == Q4_1 ? 2 * k : k]);
      }
    }
  }
  if constexpr (QT == Q4_1)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) mins[i][j] = min4[i][j][1] + min4[i][j][3] + min4[i][j][5] + min4[i][j][7];
#endif
  // every block (portable, or AVX2 with MR > 1); the last nb % 4 (AVX2, MR = 1)
  for (; b < nb; ++b) {
    if (first) prefetch(ahead, end, b * span / nb, (b + 1) * span / nb);
    Codes x[MR];
    for (int i = 0; i < MR; ++i) x[i] = x_codes(a.xq + (t + i) * a.K + 32 * b);
    for (int j = 0; j < NR; ++j) {
      const uint8_t* p = a.blocks + (n + j) * a.row_bytes + b * block_bytes(QT);
      const Codes w = w_codes<QT>(p);
      const float dw = half(p);
      for (int i = 0; i < MR; ++i) {
        madd_block<QT>(acc[i][j], w, x[i], a.xd[(t + i) * nb + b] * dw);
        if constexpr (QT == Q4_1) mins[i][j] += half(p + 2) * a.xs[(t + i) * nb + b];
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) a.out[(t + i) * a.ldo + n + j] = total(acc[i][j]) + mins[i][j];
}

template <int QT, int MR, int NR>
inline void q8_tiles(const Q8Job& a, int64_t t, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) q8_tile<QT, MR, NR>(a, t, n);
  for (; n < n1; ++n) q8_tile<QT, MR, 1>(a, t, n);
}

// Output rows [n0, n1): groups of Q8_GROUP weight rows (a few KiB, kept in L1) against every
// row of x, four rows of x at a time.
template <int QT>
void q8_rows(const Q8Job& a, int64_t n0, int64_t n1) {
  for (int64_t g = n0; g < n1; g += Q8_GROUP) {
    const int64_t g1 = std::min(n1, g + Q8_GROUP);
    int64_t t = 0;
    for (; t + 4 <= a.T; t += 4) q8_tiles<QT, 4, 1>(a, t, g, g1);
    switch (a.T - t) {
      case 3: q8_tiles<QT, 3, 2>(a, t, g, g1); break;
      case 2: q8_tiles<QT, 2, 2>(a, t, g, g1); break;
      case 1: q8_tiles<QT, 1, 4>(a, t, g, g1); break;
      default: break;
    }
  }
}

inline void q8_matmul(const Q8Job& a, int64_t n0, int64_t n1) {
  switch (a.qtype) {
    case Q4_0: return q8_rows<Q4_0>(a, n0, n1);
    case Q4_1: return q8_rows<Q4_1>(a, n0, n1);
    default: return q8_rows<Q8_0>(a, n0, n1);
  }
}
