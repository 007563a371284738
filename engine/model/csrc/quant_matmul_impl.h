// The body of the GGUF block kernels for one instruction set. quant_matmul.cpp includes this
// file once per ISA, each time inside its own namespace, under a target pragma, with SW (fp32
// lanes per vector) defined: 16 for AVX-512, 8 for AVX2+FMA, 4 for the portable build. The
// code is GCC/Clang vector extensions, so the compiler maps it onto the registers that target
// has (one zmm, one ymm, or an SSE2/scalar sequence).
//
// Block layouts (32 weights each, ggml's): Q4_0 = fp16 d, 16 bytes of nibbles, w = (q - 8) d;
// Q4_1 = fp16 d, fp16 m, 16 bytes of nibbles, w = q d + m; Q8_0 = fp16 d, 32 int8, w = q d.
// Q5_0 runs only with fp32 scales (dequant_q5_0_scaled). The k-quants (256-weight super-blocks)
// run only repacked (quant_kernel.repack), into layouts of 32 weights that take fewer
// instructions per weight: U4 (Q4_K's nibbles, as Q4_0 orders them), I8 (Q6_K's and Q3_K's codes
// as int8) and U8 (Q5_K's codes); dequant_q4_scaled, dequant_i8_scaled, dequant_u8_scaled.
// Nibble j of a block is the low half of byte j (weights 0..15), the high half is weight j+16.
// Every product q*d is exact in fp32 (at most 8 + 11 significant bits), so whether the
// compiler fuses "q*d + m" or not, a dequantized weight equals gguf's numpy dequantization.
//
// Q4 blocks may come with their scales already in fp32 (Job::scales, [N, K/32, 2], from
// quant_kernel.block_scales): {d, m} for Q4_1 and {d, -8 d} for Q4_0, so both are
// w = q * s0 + s1 with one rounding, the same weight as above ((q - 8) d = q d - 8 d exactly).
// A block then costs no fp16 conversions and its codes are widened straight from memory: at
// one row of x the kernel is bound by instructions per block, not by memory.

using vf = float __attribute__((vector_size(SW * 4)));

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
#if STEPWISE_SW > 4
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

constexpr int NV = 32 / SW;  // vectors per block

// One block (32 weights) -> w[0..NV-1], SW weights each, in order.
template <int QT>
inline void dequant_block(const uint8_t* b, vf* w) {
  const float d = half(b);
#if STEPWISE_SW == 16
  if constexpr (QT == Q8_0) {
    for (int h = 0; h < 2; ++h)
      w[h] = (vf)_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2 + 16 * h)))),
                               _mm512_set1_ps(d));
  } else {
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + (QT == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)));
    if constexpr (QT == Q4_1) {
      const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(half(b + 2));
      w[0] = (vf)_mm512_fmadd_ps(lo, dv, mv), w[1] = (vf)_mm512_fmadd_ps(hi, dv, mv);
    } else {  // gguf's order: (q - 8) * d
      const __m512 dv = _mm512_set1_ps(d), eight = _mm512_set1_ps(8.f);
      w[0] = (vf)_mm512_mul_ps(_mm512_sub_ps(lo, eight), dv), w[1] = (vf)_mm512_mul_ps(_mm512_sub_ps(hi, eight), dv);
    }
  }
#elif STEPWISE_SW == 8
  if constexpr (QT == Q8_0) {
    for (int h = 0; h < 4; ++h)
      w[h] = (vf)_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 2 + 8 * h)))),
                               _mm256_set1_ps(d));
  } else {
    const __m128i q = _mm_loadu_si128((const __m128i*)(b + (QT == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    const __m256 f[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
    const __m256 dv = _mm256_set1_ps(d);
    if constexpr (QT == Q4_1) {
      const __m256 mv = _mm256_set1_ps(half(b + 2));
      for (int h = 0; h < 4; ++h) w[h] = (vf)_mm256_fmadd_ps(f[h], dv, mv);
    } else {  // gguf's order: (q - 8) * d
      for (int h = 0; h < 4; ++h) w[h] = (vf)_mm256_mul_ps(_mm256_sub_ps(f[h], _mm256_set1_ps(8.f)), dv);
    }
  }
#else
  float tmp[32];
  if constexpr (QT == Q8_0) {
    for (int j = 0; j < 32; ++j) tmp[j] = float(int8_t(b[2 + j])) * d;
  } else {
    const uint8_t* q = b + (QT == Q4_1 ? 4 : 2);
    const float m = QT == Q4_1 ? half(b + 2) : 0.f;
    for (int j = 0; j < 16; ++j) {
      const float lo = float(q[j] & 15), hi = float(q[j] >> 4);
      tmp[j] = QT == Q4_1 ? lo * d + m : (lo - 8.f) * d;
      tmp[j + 16] = QT == Q4_1 ? hi * d + m : (hi - 8.f) * d;
    }
  }
  std::memcpy(w, tmp, sizeof tmp);
#endif
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// One Q4 block (QT = Q4_0, Q4_1, or U4: the nibbles alone) with its fp32 scale pair s -> w[0..NV-1], in order.
template <int QT>
inline void dequant_q4_scaled(const uint8_t* b, const float* s, vf* w) {
  const uint8_t* q = b + (QT == Q4_1 ? 4 : QT == Q4_0 ? 2 : 0);
#if STEPWISE_SW == 16
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));  // byte j: weights j, j + 16
  const __m512 d = _mm512_set1_ps(s[0]), m = _mm512_set1_ps(s[1]);
  w[0] = (vf)_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(15))), d, m);
  w[1] = (vf)_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)), d, m);
#elif STEPWISE_SW == 8
  const __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));        // weights 0..7, 16..23
  const __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8)));  // weights 8..15, 24..31
  const __m256i mask = _mm256_set1_epi32(15);
  const __m256 d = _mm256_set1_ps(s[0]), m = _mm256_set1_ps(s[1]);
  w[0] = (vf)_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c0, mask)), d, m);
  w[1] = (vf)_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c1, mask)), d, m);
  w[2] = (vf)_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4)), d, m);
  w[3] = (vf)_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4)), d, m);
#else
  float tmp[32];
  for (int j = 0; j < 16; ++j) {
    tmp[j] = float(q[j] & 15) * s[0] + s[1];
    tmp[j + 16] = float(q[j] >> 4) * s[0] + s[1];
  }
  std::memcpy(w, tmp, sizeof tmp);
#endif
}

// 32 I8 codes with the scales of their two 16-weight halves s -> w[0..NV-1]: w = c s, exact
// (c has 6 significant bits, s = d sc at most 19), as Q6_K's (q - 32) d sc.
inline void dequant_i8_scaled(const uint8_t* b, const float* s, vf* w) {
#if STEPWISE_SW == 16
  for (int h = 0; h < 2; ++h)
    w[h] = (vf)_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 16 * h)))),
                             _mm512_set1_ps(s[h]));
#elif STEPWISE_SW == 8
  for (int h = 0; h < 4; ++h)
    w[h] = (vf)_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 8 * h)))),
                             _mm256_set1_ps(s[h >> 1]));
#else
  float tmp[32];
  for (int i = 0; i < 32; ++i) tmp[i] = float(int8_t(b[i])) * s[i >> 4];
  std::memcpy(w, tmp, sizeof tmp);
#endif
}

// 32 U8 codes with their scale pair s -> w[0..NV-1]: w = q s0 + s1, one rounding of exact
// terms, as Q5_K's (d sc) q - dmin m.
inline void dequant_u8_scaled(const uint8_t* b, const float* s, vf* w) {
#if STEPWISE_SW == 16
  const __m512 d = _mm512_set1_ps(s[0]), m = _mm512_set1_ps(s[1]);
  for (int h = 0; h < 2; ++h)
    w[h] = (vf)_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 16 * h)))),
                               d, m);
#elif STEPWISE_SW == 8
  const __m256 d = _mm256_set1_ps(s[0]), m = _mm256_set1_ps(s[1]);
  for (int h = 0; h < 4; ++h)
    w[h] = (vf)_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + 8 * h)))),
                               d, m);
#else
  float tmp[32];
  for (int i = 0; i < 32; ++i) tmp[i] = float(b[i]) * s[0] + s[1];
  std::memcpy(w, tmp, sizeof tmp);
#endif
}

// One Q5_0 block with its scale pair s = (d, -16 d) -> w[0..NV-1]. Layout: fp16 d, 32 high
// bits qh (bit j: weight j's fifth bit), 16 bytes of nibbles as Q4_0's; w = (q - 16) d =
// q * s0 + s1 exactly (q d has at most 5 + 11 significant bits).
inline void dequant_q5_0_scaled(const uint8_t* b, const float* s, vf* w) {
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* q = b + 6;
#if STEPWISE_SW == 16
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));  // byte j: weights j, j + 16
  const __m512i sixteen = _mm512_set1_epi32(16);  // a fifth bit, set in the lanes qh's bits select
  const __m512i lo = _mm512_and_si512(c, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(c, 4);
  const __m512 d = _mm512_set1_ps(s[0]), m = _mm512_set1_ps(s[1]);
  w[0] = (vf)_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mask_or_epi32(lo, __mmask16(qh), lo, sixteen)), d, m);
  w[1] = (vf)_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mask_or_epi32(hi, __mmask16(qh >> 16), hi, sixteen)), d, m);
#elif STEPWISE_SW == 8
  const __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));        // weights 0..7, 16..23
  const __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8)));  // weights 8..15, 24..31
  const __m256i hb = _mm256_set1_epi32(int(qh)), one = _mm256_set1_epi32(1), mask = _mm256_set1_epi32(15);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 d = _mm256_set1_ps(s[0]), m = _mm256_set1_ps(s[1]);
  const __m256i codes[4] = {_mm256_and_si256(c0, mask), _mm256_and_si256(c1, mask), _mm256_srli_epi32(c0, 4),
                            _mm256_srli_epi32(c1, 4)};
  for (int h = 0; h < 4; ++h) {
    const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(hb, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * h))), one);
    w[h] = (vf)_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_or_si256(codes[h], _mm256_slli_epi32(bit, 4))), d, m);
  }
#else
  float tmp[32];
  for (int j = 0; j < 16; ++j) {
    tmp[j] = float((q[j] & 15) | ((qh >> j) & 1) << 4) * s[0] + s[1];
    tmp[j + 16] = float((q[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) * s[0] + s[1];
  }
  std::memcpy(w, tmp, sizeof tmp);
#endif
}

// 32-weight block b of weight row n: from the fp32 scales (SCALED, or a scales_only type) or
// from the block's own.
template <int QT, bool SCALED>
inline void dequant_at(const uint8_t* blocks, int64_t row_bytes, const float* scales, int64_t nb, int64_t n, int64_t b,
                       vf* w) {
  const uint8_t* row = blocks + n * row_bytes;
  if constexpr (QT == Q5_0)
    dequant_q5_0_scaled(row + b * block_bytes(QT), scales + (n * nb + b) * 2, w);
  else if constexpr (QT == I8)
    dequant_i8_scaled(row + b * block_bytes(QT), scales + (n * nb + b) * 2, w);
  else if constexpr (QT == U8)
    dequant_u8_scaled(row + b * block_bytes(QT), scales + (n * nb + b) * 2, w);
  else if constexpr (QT == U4 || (SCALED && QT != Q8_0))
    dequant_q4_scaled<QT>(row + b * block_bytes(QT), scales + (n * nb + b) * 2, w);
  else
    dequant_block<QT>(row + b * block_bytes(QT), w);
}

// Weight rows [n0, n1) dequantized into out[n - n0, K].
template <int QT>
void dequant_rows(const uint8_t* blocks, int64_t row_bytes, const float* scales, int64_t K, float* out, int64_t n0,
                  int64_t n1) {
  const int64_t nb = K / 32;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      vf w[NV];
      if (QT != Q8_0 && scales)
        dequant_at<QT, true>(blocks, row_bytes, scales, nb, n, b, w);
      else
        dequant_at<QT, false>(blocks, row_bytes, scales, nb, n, b, w);
      for (int v = 0; v < NV; ++v) store(out + (n - n0) * K + b * 32 + v * SW, w[v]);
    }
}

// out[t, n] = x[t, :] . w[n, :] for MR rows of x and NR (dequantized, fp32) rows of w: dot
// products along k, summed across lanes at the end. For fewer rows of x than a vector holds
// (the outer products below would pad them to one).
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

// x rows [0, T) packed k-major in strips of SW rows, zero-padded to TP rows (a multiple of 16):
// strip s is [K, SW], xt[(s * K + k) * SW + c] = x[s * SW + c, k], read front to back by micro_t.
inline void pack_x(const Job& a, int64_t TP, float* xt) {
  for (int64_t t = 0; t < TP; ++t) {
    float* strip = xt + (t / SW) * a.K * SW + t % SW;
    for (int64_t k = 0; k < a.K; ++k) strip[k * SW] = t < a.T ? a.x[t * a.ldx + k] : 0.f;
  }
}

// out[t0 + c, n + i] = w[i, :] . x[t0 + c, :] for MW (dequantized, fp32) rows of w and NX * SW
// rows of x (xt: their NX packed strips). Outer products: each k broadcasts one weight per row
// against NX vectors of x, MW * NX accumulators (AVX2: 12 of the 16 registers), no sums across
// lanes. Columns at or past `cols` (the padding) are not written.
template <int MW, int NX>
inline void micro_t(const float* xt, const float* w, int64_t K, int64_t cols, float* out, int64_t ldo) {
  vf acc[MW][NX] = {};
  for (int64_t k = 0; k < K; ++k) {
    vf xv[NX];
    for (int v = 0; v < NX; ++v) xv[v] = load(xt + (v * K + k) * SW);
    for (int i = 0; i < MW; ++i) {
      const float wk = w[i * K + k];
      for (int v = 0; v < NX; ++v) acc[i][v] += xv[v] * wk;
    }
  }
  for (int i = 0; i < MW; ++i)
    for (int v = 0; v < NX; ++v) {
      float lanes[SW];
      store(lanes, acc[i][v]);
      for (int c = 0; c < SW && v * SW + c < cols; ++c) out[(v * SW + c) * ldo + i] = lanes[c];
    }
}

template <int NX>
inline void micro_rows(int mw, const float* xt, const float* w, int64_t K, int64_t cols, float* out, int64_t ldo) {
  switch (mw) {
    case 6: return micro_t<6, NX>(xt, w, K, cols, out, ldo);
    case 5: return micro_t<5, NX>(xt, w, K, cols, out, ldo);
    case 4: return micro_t<4, NX>(xt, w, K, cols, out, ldo);
    case 3: return micro_t<3, NX>(xt, w, K, cols, out, ldo);
    case 2: return micro_t<2, NX>(xt, w, K, cols, out, ldo);
    default: return micro_t<1, NX>(xt, w, K, cols, out, ldo);
  }
}

// Every row of x (packed, xt) against `rows` panel rows: tiles of 2 strips of x rows by 6
// weight rows; the last tile of x rows takes one strip where that covers what is left.
inline void panel_product(const Job& a, const float* xt, const float* panel, int64_t rows, float* out) {
  for (int64_t t0 = 0; t0 < a.T; t0 += 2 * SW) {
    const int64_t cols = std::min<int64_t>(2 * SW, a.T - t0);
    const float* strips = xt + t0 * a.K;  // strip t0 / SW
    for (int64_t j = 0; j < rows; j += 6) {
      const int mw = int(std::min<int64_t>(6, rows - j));
      if (cols > SW)
        micro_rows<2>(mw, strips, panel + j * a.K, a.K, cols, out + t0 * a.ldo + j, a.ldo);
      else
        micro_rows<1>(mw, strips, panel + j * a.K, a.K, cols, out + t0 * a.ldo + j, a.ldo);
    }
  }
}

// Few rows of x (decode): weights dequantized into registers and used at once, no panel.
// Two accumulators per (row, weight row) pair keep two FMA chains in flight.
template <int QT, bool SCALED, int MR, int NR>
inline void direct(const Job& a, int64_t t, int64_t n) {
  vf acc[MR][NR][2] = {};
  const int64_t nb = a.K / 32;
  // The NR rows are one contiguous run of bytes; while it is read, the run PREFETCH_GROUPS
  // runs ahead is requested, a block's share of its lines at a time (there is little
  // memory-level parallelism otherwise: each block takes more arithmetic than the hardware
  // prefetcher's look-ahead).
  const int64_t group_bytes = NR * a.row_bytes, share = (group_bytes + nb - 1) / nb;
  const uint8_t* ahead = a.blocks + n * a.row_bytes + PREFETCH_GROUPS * group_bytes;
  const uint8_t* end = a.blocks + a.N * a.row_bytes;
  for (int64_t b = 0; b < nb; ++b, ahead += share) {
    for (const uint8_t* line = ahead; line < ahead + share && line < end; line += 64) __builtin_prefetch(line, 0, 0);
    for (int j = 0; j < NR; ++j) {
      vf w[NV];
      dequant_at<QT, SCALED>(a.blocks, a.row_bytes, a.scales, nb, n + j, b, w);
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < NV; ++v) acc[i][j][v & 1] += load(a.x + (t + i) * a.ldx + b * 32 + v * SW) * w[v];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) a.out[(t + i) * a.ldo + n + j] = hsum(acc[i][j][0] + acc[i][j][1]);
}

template <int QT, bool SCALED, int MR, int NR>
inline void direct_rows(const Job& a, int64_t t, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) direct<QT, SCALED, MR, NR>(a, t, n);
  for (; n < n1; ++n) direct<QT, SCALED, MR, 1>(a, t, n);
}

template <int QT, bool SCALED>
void direct_all(const Job& a, int64_t n0, int64_t n1) {
  switch (a.T) {
    case 1: return direct_rows<QT, SCALED, 1, 4>(a, 0, n0, n1);
    case 2: return direct_rows<QT, SCALED, 2, 2>(a, 0, n0, n1);
    default: return direct_rows<QT, SCALED, 3, 1>(a, 0, n0, n1);
  }
}

// Output rows [n0, n1) of y = x . dequant(W)^T. More rows of x than DIRECT_MAX_ROWS: panels of
// PANEL weight rows are dequantized (fp32, L1/L2) and multiplied by every row of x, by outer
// products on x packed once (`scratch`: pack_x) where x has a vector's worth of rows, else by
// dot products; the weight bytes are read from memory once per step whatever the row count.
// `scratch` holds panel_scratch(T, K) floats.
template <int QT>
void matmul_rows(const Job& a, int64_t n0, int64_t n1, float* scratch) {
  if (a.T <= DIRECT_MAX_ROWS) {
    if constexpr (scales_only(QT)) return direct_all<QT, true>(a, n0, n1);
    if constexpr (QT != Q8_0)
      if (a.scales) return direct_all<QT, true>(a, n0, n1);
    return direct_all<QT, false>(a, n0, n1);
  }
  const int64_t K = a.K, TP = packed_rows(a.T);
  const bool outer = a.T >= SW;  // at least one whole strip of x rows
  float *xt = scratch, *panel = scratch + K * TP;
  // Every thread packs all of x for itself. Packing once on the calling thread before the
  // threads start saves that CPU time but costs wall time: 1-3 % slower at 8-32 rows on 2 threads
  // (the AVX2 stand-in, alternating), as the other threads wait and then read it from afar.
  if (outer) pack_x(a, TP, xt);
  for (int64_t p = n0; p < n1; p += PANEL) {
    const int64_t rows = std::min<int64_t>(PANEL, n1 - p);
    dequant_rows<QT>(a.blocks, a.row_bytes, a.scales, K, panel, p, p + rows);
    if (outer) {
      panel_product(a, xt, panel, rows, a.out + p);
      continue;
    }
    int64_t j = 0;
    for (; j + 2 <= rows; j += 2) rows_x_panel<2>(a.x, a.ldx, a.T, panel + j * K, K, a.out + p + j, a.ldo);
    if (j < rows) rows_x_panel<1>(a.x, a.ldx, a.T, panel + j * K, K, a.out + p + j, a.ldo);
  }
}

inline void matmul(const Job& a, int64_t n0, int64_t n1, float* scratch) {
  switch (a.qtype) {
    case Q4_0: return matmul_rows<Q4_0>(a, n0, n1, scratch);
    case Q4_1: return matmul_rows<Q4_1>(a, n0, n1, scratch);
    case Q5_0: return matmul_rows<Q5_0>(a, n0, n1, scratch);
    case U4: return matmul_rows<U4>(a, n0, n1, scratch);
    case I8: return matmul_rows<I8>(a, n0, n1, scratch);
    case U8: return matmul_rows<U8>(a, n0, n1, scratch);
    default: return matmul_rows<Q8_0>(a, n0, n1, scratch);
  }
}

inline void dequant(const Job& a, int64_t n0, int64_t n1) {
  switch (a.qtype) {
    case Q4_0: return dequant_rows<Q4_0>(a.blocks, a.row_bytes, a.scales, a.K, a.out + n0 * a.K, n0, n1);
    case Q4_1: return dequant_rows<Q4_1>(a.blocks, a.row_bytes, a.scales, a.K, a.out + n0 * a.K, n0, n1);
    case Q5_0: return dequant_rows<Q5_0>(a.blocks, a.row_bytes, a.scales, a.K, a.out + n0 * a.K, n0, n1);
    case U4: return dequant_rows<U4>(a.blocks, a.row_bytes, a.scales, a.K, a.out + n0 * a.K, n0, n1);
    case I8: return dequant_rows<I8>(a.blocks, a.row_bytes, a.scales, a.K, a.out + n0 * a.K, n0, n1);
    case U8: return dequant_rows<U8>(a.blocks, a.row_bytes, a.scales, a.K, a.out + n0 * a.K, n0, n1);
    default: return dequant_rows<Q8_0>(a.blocks, a.row_bytes, a.scales, a.K, a.out + n0 * a.K, n0, n1);
  }
}
