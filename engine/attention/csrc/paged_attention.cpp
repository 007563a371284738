// Paged attention on CPU, straight from the paged KV cache (no gather), after storing the
// step's keys/values into it. Built at first use by
// engine/attention/cpu_backend.py and registered as torch.ops.stepwise_cpu.paged_attention.
//
// Work item = (tile, kv head g): a tile is up to a few consecutive query tokens of one
// sequence; its rows are those tokens x the G = H / KVH query heads sharing kv head g, so each
// K/V row is loaded once per item. Keys are visited in chunks of KC positions: first the
// cached context (0..ctx-1, read through the block table), then the sequence's fresh keys
// (ctx..last position of the tile, read from this step's k/v), each row only up to its own
// position (causal) and, on a sliding-window layer, from its window's first position on (chunks
// wholly before a tile's window are skipped). Scores are q.k times the layer's scale, tanh
// soft-capped when the layer asks (Gemma 2). Online softmax per row (running max m, running sum l), fp32 accumulation.
// Rows are processed in register blocks of up to RB_MAX rows (sharing each V load); scores
// for 8 keys at a time are reduced together (transpose_reduce), not one horizontal sum each.
// Items are pulled from an atomic counter (tiles come sorted longest first) so threads balance.
//
// SIMD through GCC/Clang vector extensions (8 fp32 lanes): portable C++ that any target
// compiles; -march=native turns the vectors into single AVX2/FMA registers. 16 lanes (AVX-512)
// measured slower on Zen 4, whose 512-bit ops are double-pumped.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int SW = 8;       // SIMD lanes
constexpr int KC = 16;      // keys per chunk
constexpr int KV = KC / SW;  // vectors per row of KC scores
constexpr int RB_MAX = 4;   // rows per register block

using vf = float __attribute__((vector_size(SW * 4)));
using vi = int32_t __attribute__((vector_size(SW * 4)));
using v4 = float __attribute__((vector_size(16)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load(const c10::BFloat16* p) {  // bf16 = top half of an fp32
  using vu16 = uint16_t __attribute__((vector_size(SW * 2)));
  using vu32 = uint32_t __attribute__((vector_size(SW * 4)));
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  vu32 w = __builtin_convertvector(h, vu32) << 16;
  vf v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
inline vf load(const c10::Half* p) {  // an fp16 KV cache (kv_cache_dtype = "float16")
  vf v;
#ifdef __F16C__
  const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &x, sizeof v);
#else
  for (int j = 0; j < SW; ++j) v[j] = static_cast<float>(p[j]);
#endif
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(c10::Half x) { return static_cast<float>(x); }

inline float hsum(vf a) {
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  b += __builtin_shufflevector(b, b, 2, 3, 0, 1);
  b += __builtin_shufflevector(b, b, 1, 0, 3, 2);
  return b[0];
}

// Transpose-reduce: SW vectors of partial sums -> one vector of their SW sums, in SW - 1
// (two-source shuffle, shuffle, add) steps instead of SW horizontal sums. A step folds each
// 2h-lane block of x and of y in half and interleaves them; after all steps lane t holds the
// sum of input bitrev(t), so callers feed input j with key bitrev(j).
template <int h, int j>
constexpr int lo_lane() {
  return j % (2 * h) < h ? j / (2 * h) * 2 * h + j % (2 * h) : SW + j / (2 * h) * 2 * h + j % (2 * h) - h;
}
template <int h, int... j>
inline vf combine(vf x, vf y, std::integer_sequence<int, j...>) {
  return __builtin_shufflevector(x, y, lo_lane<h, j>()...) + __builtin_shufflevector(x, y, (lo_lane<h, j>() + h)...);
}
template <int h>
inline void fold(vf* x, int n) {
  for (int j = 0; j < n / 2; ++j) x[j] = combine<h>(x[2 * j], x[2 * j + 1], std::make_integer_sequence<int, SW>{});
}
inline vf transpose_reduce(vf* x) {
  fold<4>(x, 8), fold<2>(x, 4), fold<1>(x, 2);
  return x[0];
}
constexpr int bitrev(int j) {
  int out = 0;
  for (int b = 1; b < SW; b <<= 1, j >>= 1) out = out * 2 + (j & 1);
  return out;
}

// e^x for x <= 0, SW lanes at a time (Cephes expf polynomial, ~1 ulp; below -87 gives ~0).
__attribute__((always_inline)) inline vf exp_neg(vf x) {
  x = x < -87.f ? vf{} - 87.f : x;
  const vf n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(x / ln 2)
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf y = vf{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n
  vf p2;
  std::memcpy(&p2, &bits, sizeof p2);
  return y * p2;
}

inline float hmax(vf v) {
  float out = v[0];
  for (int j = 1; j < SW; ++j) out = std::max(out, v[j]);
  return out;
}

// Running state of RB rows: q [RB, D] (scaled fp32), acc [RB, D], m/l [RB], and each row's
// visible keys lo[r]..pos[r]. softcap > 0: scores -> softcap * tanh(scores / softcap).
struct Rows {
  const float* q;
  float* acc;
  float* m;
  float* l;
  const int* pos;
  const int* lo;
  float softcap;
};

// One register block of RB rows against the n keys at positions p0.. (row pointers kp/vp,
// padded to KC with repeats of the last): scores, online-softmax update, P.V accumulation.
template <int RB, typename T, int DC>
inline void block(const Rows& w, const T* const* kp, const T* const* vp, int n, int p0, int D_rt) {
  const int D = DC ? DC : D_rt;
  const int nv = D / SW;
  float s[RB][KC] = {}, alpha[RB];  // scores, then probabilities
  for (int r = 0; r < RB; ++r)  // s = q . k, SW keys at a time (kp is padded to KC keys)
    for (int c0 = 0; c0 < KC; c0 += SW) {
      vf part[SW];
      for (int j = 0; j < SW; ++j) {
        const T* k = kp[c0 + bitrev(j)];
        vf acc{};
        for (int i = 0; i < nv; ++i) acc += load(w.q + r * D + i * SW) * load(k + i * SW);
        part[j] = acc;
      }
      vf sv = transpose_reduce(part);
      for (int d = nv * SW; d < D; ++d)  // tail of D not a multiple of SW
        for (int j = 0; j < SW; ++j) sv[j] += w.q[r * D + d] * to_f(kp[c0 + j][d]);
      std::memcpy(&s[r][c0], &sv, sizeof sv);
    }
  if (w.softcap > 0.f)
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < n; ++c) s[r][c] = w.softcap * std::tanh(s[r][c] / w.softcap);
  // Online softmax; keys outside a row's lo..pos get p = 0, and a row with none keeps its state
  // (alpha = 1). The rows' rescale factors e^(m - m_new) come from one vector exp for all RB
  // rows: a libm call per row put every live vector register on the stack and back.
  static_assert(RB <= SW, "one lane per row");
  vi lane;
  for (int j = 0; j < SW; ++j) lane[j] = j;
  int begin[RB], valid[RB];
  float m_new[RB];
  vf shift{};  // lane r: m - m_new of row r (<= 0; -inf on a row's first chunk, 0 if no key)
  for (int r = 0; r < RB; ++r) {
    begin[r] = std::max(0, w.lo[r] - p0), valid[r] = std::min(n, w.pos[r] - p0 + 1);
    vf mv = vf{} - std::numeric_limits<float>::infinity();
    for (int j = 0; j < KV; ++j) {
      vf x;
      std::memcpy(&x, &s[r][j * SW], sizeof x);
      mv = ((lane + j * SW >= begin[r]) & (lane + j * SW < valid[r]) & (x > mv)) ? x : mv;
    }
    m_new[r] = valid[r] > begin[r] ? std::max(w.m[r], hmax(mv)) : w.m[r];
    shift[r] = valid[r] > begin[r] ? w.m[r] - m_new[r] : 0.f;
  }
  const vf factor = exp_neg(shift);  // e^-inf -> e^-87 ~ 1e-38, which only ever scales zeros
  for (int r = 0; r < RB; ++r) {
    alpha[r] = factor[r];
    vf sum{};
    for (int j = 0; j < KV; ++j) {
      vf x;
      std::memcpy(&x, &s[r][j * SW], sizeof x);
      x = (lane + j * SW >= begin[r]) & (lane + j * SW < valid[r]) ? exp_neg(x - m_new[r]) : vf{};
      std::memcpy(&s[r][j * SW], &x, sizeof x);
      sum += x;
    }
    w.l[r] = w.l[r] * alpha[r] + hsum(sum);
    w.m[r] = m_new[r];
  }
  // acc = acc * alpha + p . v, IV vectors of D per pass: RB x IV accumulators stay in (16)
  // registers, and a key costs IV loads of V + RB broadcasts for RB x IV FMAs (was 1 + RB for RB).
  constexpr int IV = RB <= 2 ? 4 : 2;
  int i = 0;
  for (; i + IV <= nv; i += IV) {
    vf o[RB][IV];
    for (int r = 0; r < RB; ++r)
      for (int u = 0; u < IV; ++u) o[r][u] = load(w.acc + r * D + (i + u) * SW) * alpha[r];
    for (int c = 0; c < KC; ++c) {
      vf x[IV];
      for (int u = 0; u < IV; ++u) x[u] = load(vp[c] + (i + u) * SW);
      for (int r = 0; r < RB; ++r)
        for (int u = 0; u < IV; ++u) o[r][u] += s[r][c] * x[u];
    }
    for (int r = 0; r < RB; ++r)
      for (int u = 0; u < IV; ++u) store(w.acc + r * D + (i + u) * SW, o[r][u]);
  }
  for (; i < nv; ++i) {  // the same, one vector at a time (D / SW not a multiple of IV)
    vf o[RB];
    for (int r = 0; r < RB; ++r) o[r] = load(w.acc + r * D + i * SW) * alpha[r];
    for (int c = 0; c < KC; ++c) {
      const vf x = load(vp[c] + i * SW);
      for (int r = 0; r < RB; ++r) o[r] += s[r][c] * x;
    }
    for (int r = 0; r < RB; ++r) store(w.acc + r * D + i * SW, o[r]);
  }
  for (int d = nv * SW; d < D; ++d)
    for (int r = 0; r < RB; ++r) {
      float x = w.acc[r * D + d] * alpha[r];
      for (int c = 0; c < n; ++c) x += s[r][c] * to_f(vp[c][d]);
      w.acc[r * D + d] = x;
    }
}

struct Args {
  const void *q, *k, *v, *kc, *vc;
  void* out;
  const int32_t* tiles;   // [num_tiles, 5]: seq, first token, num tokens, ctx, first position
  const int32_t* tables;  // [B, W]
  int64_t table_stride;
  int64_t sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h;  // row / head strides (elements)
  int64_t sc_b, sc_o, sc_h;                               // cache block / offset / head strides
  int num_tiles, H, KVH, G, D, block_size, max_rows;
  int window;  // 0 = every earlier key; else a row at position p sees p - window + 1 .. p
  float scale, softcap;  // softcap 0 = none
};

// One row of D values into the cache's type, rounded to nearest even (as torch's .to()).
template <typename T, typename C>
inline void store_row(C* dst, const T* src, int D) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(dst, src, size_t(D) * sizeof(T));
  } else {
    int d = 0;
#ifdef __F16C__
    if constexpr (std::is_same_v<T, float> && std::is_same_v<C, c10::Half>)
      for (; d + 8 <= D; d += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; d < D; ++d) dst[d] = static_cast<C>(static_cast<float>(src[d]));
  }
}

// D values of a narrower cache row widened to fp32.
template <typename C>
inline void widen_row(float* dst, const C* src, int D) {
  int d = 0;
  for (; d + SW <= D; d += SW) store(dst + d, load(src + d));
  for (; d < D; ++d) dst[d] = to_f(src[d]);
}

// D fresh values as a cache of type C would hold them, widened back to fp32.
template <typename T, typename C>
inline void round_row(float* dst, const T* src, int D) {
  int d = 0;
#ifdef __F16C__
  if constexpr (std::is_same_v<T, float> && std::is_same_v<C, c10::Half>)
    for (; d + 8 <= D; d += 8)
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT)));
#endif
  for (; d < D; ++d) dst[d] = static_cast<float>(static_cast<C>(static_cast<float>(src[d])));
}

// T: q/k/v/out; C: the cache (T, or a narrower KV dtype). Every key and value is read as C holds
// it, the step's fresh ones too (rounded into a small fp32 buffer), so a token's attention does
// not depend on whether its keys were stored this step or an earlier one. A tile of more rows
// than one register block reads each key once per block: its narrow rows are widened to fp32
// once per chunk first (decode tiles, a few rows, read them as they are: half the bytes).
template <typename T, typename C, int DC>
void run(const Args& a) {
  const int D = DC ? DC : a.D;
  const int64_t num_items = int64_t(a.num_tiles) * a.KVH;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> qf(a.max_rows * D), acc(a.max_rows * D), m(a.max_rows), l(a.max_rows);
    std::vector<int> pos(a.max_rows), lo(a.max_rows);
    const C* ckp[KC];  // a chunk's cached rows
    const C* cvp[KC];
    const T* kp[KC];  // a chunk's fresh rows
    const T* vp[KC];
    std::vector<float> wide_k(std::is_same_v<T, C> ? 0 : KC * D), wide_v(wide_k.size());  // a chunk in fp32
    const float* wkp[KC];
    const float* wvp[KC];
    for (int64_t item; (item = next.fetch_add(1)) < num_items;) {
      const int32_t* t = a.tiles + (item / a.KVH) * 5;
      const int g = int(item % a.KVH), seq = t[0], tok0 = t[1], qt = t[2], ctx = t[3], pos0 = t[4];
      const int R = qt * a.G;  // rows: r = token j * G + head-in-group
      for (int r = 0; r < R; ++r) {
        const T* qr = static_cast<const T*>(a.q) + (tok0 + r / a.G) * a.sq_t + (g * a.G + r % a.G) * a.sq_h;
        for (int d = 0; d < D; ++d) qf[r * D + d] = to_f(qr[d]) * a.scale;
        std::fill(&acc[r * D], &acc[r * D] + D, 0.f);
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.f;
        pos[r] = pos0 + r / a.G;
        lo[r] = a.window ? std::max(0, pos[r] - a.window + 1) : 0;
      }
      const int lo0 = lo[0];  // the tile's earliest visible key: rows ascend in position
      auto chunk = [&](const auto* const* keys, const auto* const* values, int n, int p0) {  // rows x keys p0..
        using E = std::remove_cv_t<std::remove_pointer_t<std::remove_cv_t<std::remove_pointer_t<decltype(keys)>>>>;
        for (int r0 = 0; r0 < R; r0 += RB_MAX) {
          const Rows w{&qf[r0 * D], &acc[r0 * D], &m[r0], &l[r0], &pos[r0], &lo[r0], a.softcap};
          switch (std::min(RB_MAX, R - r0)) {
            case 1: block<1, E, DC>(w, keys, values, n, p0, D); break;
            case 2: block<2, E, DC>(w, keys, values, n, p0, D); break;
            case 3: block<3, E, DC>(w, keys, values, n, p0, D); break;
            default: block<4, E, DC>(w, keys, values, n, p0, D); break;
          }
        }
      };
      // 1) cached context through the block table. Each chunk prefetches the next one's rows
      // (the first, its own too) into L2 (L1 measured slower): scattered blocks defeat the
      // hardware prefetcher, and without this decode runs at about half the speed.
      const int32_t* table = a.tables + seq * a.table_stride;
      const C* kc = static_cast<const C*>(a.kc) + g * a.sc_h;
      const C* vc = static_cast<const C*>(a.vc) + g * a.sc_h;
      auto offset = [&](int p) { return table[p / a.block_size] * a.sc_b + (p % a.block_size) * a.sc_o; };
      const int c0 = lo0 / KC * KC;  // first chunk holding a visible key
      for (int p0 = c0; p0 < ctx; p0 += KC) {
        const int n = std::min(KC, ctx - p0);
        for (int c = 0; c < n; ++c) {
          const int64_t off = offset(p0 + c);
          ckp[c] = kc + off;
          cvp[c] = vc + off;
        }
        std::fill(ckp + n, ckp + KC, ckp[n - 1]), std::fill(cvp + n, cvp + KC, cvp[n - 1]);
        for (int p = p0 == c0 ? p0 : p0 + KC; p < std::min(ctx, p0 + 2 * KC); ++p) {
          const char* kr = reinterpret_cast<const char*>(kc + offset(p));
          const char* vr = reinterpret_cast<const char*>(vc + offset(p));
          for (int b = 0; b < D * int(sizeof(C)); b += 64) {
            __builtin_prefetch(kr + b, 0, 2);
            __builtin_prefetch(vr + b, 0, 2);
          }
        }
        if constexpr (!std::is_same_v<T, C>) {
          if (R > RB_MAX) {
            for (int c = 0; c < KC; ++c) {
              widen_row(&wide_k[c * D], ckp[c], D), widen_row(&wide_v[c * D], cvp[c], D);
              wkp[c] = &wide_k[c * D], wvp[c] = &wide_v[c * D];
            }
            chunk(wkp, wvp, n, p0);
            continue;
          }
        }
        chunk(ckp, cvp, n, p0);
      }
      // 2) fresh keys of this sequence, from this step's k/v (row of position p: first + p - ctx)
      const int first = tok0 - (pos0 - ctx), last = pos0 + qt - 1;
      for (int p0 = std::max(ctx, lo0); p0 <= last; p0 += KC) {
        const int n = std::min(KC, last - p0 + 1);
        for (int c = 0; c < n; ++c) {
          const int64_t row = first + (p0 + c - ctx);
          kp[c] = static_cast<const T*>(a.k) + row * a.sk_t + g * a.sk_h;
          vp[c] = static_cast<const T*>(a.v) + row * a.sv_t + g * a.sv_h;
        }
        std::fill(kp + n, kp + KC, kp[n - 1]), std::fill(vp + n, vp + KC, vp[n - 1]);
        if constexpr (std::is_same_v<T, C>) {
          chunk(kp, vp, n, p0);
        } else {
          for (int c = 0; c < KC; ++c) {
            round_row<T, C>(&wide_k[c * D], kp[c], D), round_row<T, C>(&wide_v[c * D], vp[c], D);
            wkp[c] = &wide_k[c * D], wvp[c] = &wide_v[c * D];
          }
          chunk(wkp, wvp, n, p0);
        }
      }
      for (int r = 0; r < R; ++r) {
        T* o = static_cast<T*>(a.out) + (tok0 + r / a.G) * a.so_t + (g * a.G + r % a.G) * a.so_h;
        const float inv = 1.f / l[r];
        for (int d = 0; d < D; ++d) o[d] = static_cast<T>(acc[r * D + d] * inv);
      }
    }
  });
}

template <typename T, typename C>
void run_d(const Args& a) {
  switch (a.D) {
    case 64: return run<T, C, 64>(a);
    case 128: return run<T, C, 128>(a);
    default: return run<T, C, 0>(a);
  }
}

// This step's keys/values into the cache at their slots (block * block_size + offset); -1 = skip.
template <typename T, typename C>
void store_kv(const Args& a, const int64_t* slots, int64_t num_tokens) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    const int64_t base = slots[t] / a.block_size * a.sc_b + slots[t] % a.block_size * a.sc_o;
    for (int g = 0; g < a.KVH; ++g) {
      store_row(static_cast<C*>(const_cast<void*>(a.kc)) + base + g * a.sc_h,
                static_cast<const T*>(a.k) + t * a.sk_t + g * a.sk_h, a.D);
      store_row(static_cast<C*>(const_cast<void*>(a.vc)) + base + g * a.sc_h,
                static_cast<const T*>(a.v) + t * a.sv_t + g * a.sv_h, a.D);
    }
  }
}

// Store, then attend, with T = q's type and C = the cache's.
template <typename T, typename C>
void store_and_run(const Args& a, const int64_t* slots, int64_t num_tokens) {
  store_kv<T, C>(a, slots, num_tokens);
  if (a.num_tiles > 0) run_d<T, C>(a);
}

// q [T, H, D], k/v [T, KVH, D], caches [num_blocks, block_size, KVH, D] (the step's k/v are
// stored into them first, at slot_mapping [T] int64, -1 = not stored), tiles [num_tiles, 5]
// int32, block_tables [B, W] int32, out [T, H, D] (written). Last dims must be contiguous.
// q/k/v/out float32 or bfloat16; the caches the same, or narrower (float16, or bfloat16 under
// float32): stored rounded to nearest even, read back widened to fp32.
// scale: score scale; window: 0 or the sliding window; softcap: 0 or the tanh soft-cap.
// Every token of the batch must be in exactly one tile, or its output rows stay unwritten.
void paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& tiles,
                     const at::Tensor& block_tables, const at::Tensor& out, double scale, int64_t window,
                     double softcap) {
  for (const at::Tensor* x : {&q, &k, &v, &k_cache, &v_cache, &out}) {
    TORCH_CHECK(x->device().is_cpu(), "paged_attention: CPU tensors only");
    const at::Tensor& like = x == &k_cache || x == &v_cache ? k_cache : q;
    TORCH_CHECK(x->scalar_type() == like.scalar_type(), "paged_attention: q/k/v/out must share a dtype, and so must the caches");
    TORCH_CHECK(x->stride(-1) == 1, "paged_attention: last dim must be contiguous");
  }
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k_cache and v_cache must share strides");
  TORCH_CHECK(tiles.scalar_type() == at::kInt && tiles.is_contiguous() && tiles.dim() == 2 && tiles.size(1) == 5);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1);
  Args a{};
  a.q = q.data_ptr(), a.k = k.data_ptr(), a.v = v.data_ptr(), a.kc = k_cache.data_ptr(), a.vc = v_cache.data_ptr();
  a.out = out.data_ptr();
  a.tiles = tiles.data_ptr<int32_t>();
  a.tables = block_tables.data_ptr<int32_t>();
  a.table_stride = block_tables.stride(0);
  a.sq_t = q.stride(0), a.sq_h = q.stride(1), a.sk_t = k.stride(0), a.sk_h = k.stride(1);
  a.sv_t = v.stride(0), a.sv_h = v.stride(1), a.so_t = out.stride(0), a.so_h = out.stride(1);
  a.sc_b = k_cache.stride(0), a.sc_o = k_cache.stride(1), a.sc_h = k_cache.stride(2);
  a.num_tiles = int(tiles.size(0)), a.H = int(q.size(1)), a.KVH = int(k.size(1)), a.D = int(q.size(2));
  TORCH_CHECK(a.KVH > 0 && a.H % a.KVH == 0, "num_heads must be a multiple of num_kv_heads");
  a.G = a.H / a.KVH, a.block_size = int(k_cache.size(1));
  // Bounds of every index the kernel follows (a bad plan must not read out of bounds).
  const int64_t num_tokens = q.size(0), num_seqs = block_tables.size(0), width = block_tables.size(1);
  TORCH_CHECK(k.size(0) == num_tokens && v.size(0) == num_tokens && out.sizes() == q.sizes(), "token counts differ");
  TORCH_CHECK(k_cache.size(2) == a.KVH && k_cache.size(3) == a.D && v_cache.sizes() == k_cache.sizes(), "cache shape");
  int max_qt = 0;
  for (int i = 0; i < a.num_tiles; ++i) {
    const int32_t* t = a.tiles + i * 5;  // seq, first token, num tokens, ctx, first position
    TORCH_CHECK(t[0] >= 0 && t[0] < num_seqs && t[2] > 0 && t[3] >= 0 && t[4] >= t[3] &&
                    t[1] - (t[4] - t[3]) >= 0 && int64_t(t[1]) + t[2] <= num_tokens,
                "paged_attention: tile ", i, " out of range");
    const int64_t blocks = (int64_t(t[3]) + a.block_size - 1) / a.block_size;
    TORCH_CHECK(blocks <= width, "paged_attention: context longer than the block table");
    for (int64_t b = 0; b < blocks; ++b) {
      const int32_t id = a.tables[t[0] * a.table_stride + b];
      TORCH_CHECK(id >= 0 && id < k_cache.size(0), "paged_attention: bad block id ", id);
    }
    max_qt = std::max(max_qt, int(t[2]));
  }
  a.max_rows = max_qt * a.G;
  TORCH_CHECK(window >= 0 && softcap >= 0 && scale > 0, "paged_attention: bad scale, window or softcap");
  a.scale = float(scale), a.window = int(window), a.softcap = float(softcap);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == num_tokens, "paged_attention: slot_mapping must be contiguous int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * a.block_size;
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "paged_attention: slot ", slots[t], " is past the cache's ", num_slots);
  // the cache: q's dtype, or a narrower one (float16; bfloat16 under float32 q)
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16, "paged_attention: float32 or bfloat16 only, got ", qt);
  if (qt == at::kFloat && ct == at::kFloat) return store_and_run<float, float>(a, slots, num_tokens);
  if (qt == at::kFloat && ct == at::kHalf) return store_and_run<float, c10::Half>(a, slots, num_tokens);
  if (qt == at::kFloat && ct == at::kBFloat16) return store_and_run<float, c10::BFloat16>(a, slots, num_tokens);
  if (qt == at::kBFloat16 && ct == at::kBFloat16) return store_and_run<c10::BFloat16, c10::BFloat16>(a, slots, num_tokens);
  if (qt == at::kBFloat16 && ct == at::kHalf) return store_and_run<c10::BFloat16, c10::Half>(a, slots, num_tokens);
  TORCH_CHECK(false, "paged_attention: a ", qt, " q cannot use a ", ct, " KV cache (float32, float16 or bfloat16)");
}

}  // namespace

TORCH_LIBRARY(stepwise_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor tiles, Tensor block_tables, Tensor(c!) out, float scale, int window, float softcap) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}
