// A decoder layer's work around attention: two calls a layer instead of
// ~45 small ATen ops from Python, or (`layers`) every layer of a step in one call. Projections
// run on GGUF blocks (our kernel, steps of few rows) or on oneDNN-prepacked fp32 weights
// (DENSE: the dense copies, any step); elementwise passes split rows over torch's threads where
// a step has many. quant_matmul.cpp includes this file once, after run_matmul(), inside its
// anonymous namespace.
//
//   attn_in:      x = rms_norm(h); qkv = x . Wqkv^T (+ b); RoPE (rotate-half) on q and k, in place
//   attn_out_mlp: h += attn . Wo^T (+ b); x = rms_norm(h); g, u = x . Wgu^T (+ b);
//                 h += (silu(g) * u) . Wd^T (+ b)
//
// `layers` also runs what Qwen3 and Gemma add (LayerExtras): q/k norms per head before RoPE,
// norms on the attention and MLP outputs before each residual add, GeGLU (at::gelu_out, tanh).
//
// Each elementwise step keeps transformers' fp32 rounding order: x * rsqrt(mean(x^2) + eps) is
// rounded before the weight multiplies it; RoPE is x*cos + rotate_half(x)*sin; silu is torch's
// own kernel (at::silu_out), then one rounded multiply by u. Only the order of the additions in
// the norm's mean and in the products differs from the op-by-op path.

// A projection: GGUF blocks for our kernel, as the Python QuantLinear holds them (one part), or
// stacked by output rows from parts of different block types (QuantLinearStack: a Q4_K_M file's
// q/k/v, Q4_K q and k with a Q6_K v); or (DENSE) the oneDNN-prepacked fp32 weight a Linear
// holds, multiplied by oneDNN.
constexpr int64_t DENSE = -1;
constexpr int MAX_PARTS = 3;  // q, k and v

struct Part {  // some of a projection's output rows, GGUF blocks of one type
  const uint8_t* blocks;
  int64_t N, row_bytes;
  int qtype;
  const float* scales;  // [N, K/32, 2] fp32 scale pairs (Q4, Q5_0, k-quants) or nullptr
};

struct Proj {
  int64_t N = 0, K = 0;
  int num_parts = 0;
  Part parts[MAX_PARTS];
  const float* bias = nullptr;           // [N] or nullptr (blocks: we add it)
  at::Tensor packed;                     // DENSE: the prepacked weight [N, K]
  c10::optional<at::Tensor> dense_bias;  // DENSE: the bias, which oneDNN adds
  bool dense() const { return packed.defined(); }
};

// Appends weight (of ggml type qtype, or DENSE) as p's next rows.
void add_part(Proj& p, const at::Tensor& weight, int64_t qtype, int64_t isa, const c10::optional<at::Tensor>& scales) {
  if (qtype == DENSE) {
    TORCH_CHECK(p.num_parts == 0, "stepwise_gguf: a dense projection is one prepacked weight, not stacked with others");
    TORCH_CHECK(weight.is_mkldnn() && weight.scalar_type() == at::kFloat && weight.dim() == 2 && !scales.has_value(),
                "stepwise_gguf: a dense projection must be a oneDNN-prepacked float32 [N, K] weight, without scales");
    p.packed = weight;
    p.N = weight.size(0), p.K = weight.size(1), p.num_parts = 1;
    return;
  }
  TORCH_CHECK(known_type(qtype), "stepwise_gguf: unsupported ggml type ", qtype);
  TORCH_CHECK(!p.dense() && p.num_parts < MAX_PARTS, "stepwise_gguf: a projection stacks at most ", MAX_PARTS,
              " parts of GGUF blocks");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) % block_bytes(int(qtype)) == 0,
              "stepwise_gguf: blocks rows are not whole blocks of type ", qtype);
  const int64_t K = weight.size(1) / block_bytes(int(qtype)) * BLOCK_WEIGHTS;
  TORCH_CHECK(p.num_parts == 0 || K == p.K, "stepwise_gguf: stacked parts must share K (", p.K, " and ", K, ")");
  check_blocks(weight, qtype, K, isa);
  p.parts[p.num_parts++] = Part{weight.data_ptr<uint8_t>(), weight.size(0), weight.size(1), int(qtype),
                                check_scales(scales, qtype, weight.size(0), K)};
  p.N += weight.size(0), p.K = K;
}

void set_bias(Proj& p, const c10::optional<at::Tensor>& bias) {
  if (!bias.has_value()) return;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == p.N,
              "stepwise_gguf: a bias must be contiguous float32 [N]");
  if (p.dense())
    p.dense_bias = bias;
  else
    p.bias = bias->data_ptr<float>();
}

Proj proj_of(const at::Tensor& weight, int64_t qtype, const c10::optional<at::Tensor>& bias, int64_t isa,
             const c10::optional<at::Tensor>& scales) {
  Proj p;
  add_part(p, weight, qtype, isa, scales);
  set_bias(p, bias);
  return p;
}

// Rows per thread below which an elementwise pass over T rows of `width` values stays on the
// calling thread (at::parallel_for runs inline then): a decode step of few rows opens no
// parallel region for it.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// A [T, N] buffer: ours in `buf`, reused by every layer of a call (one allocation, not one a
// layer); or, for a oneDNN projection's result, the tensor oneDNN returned, held in `owner`.
struct Out {
  std::vector<float> buf;
  at::Tensor owner;
  float* data = nullptr;

  float* take(int64_t n) {  // buf as the result's storage
    if (int64_t(buf.size()) < n) buf.resize(n);
    owner.reset();
    return data = buf.data();
  }
};

// out[T, N] = x[T, K] . W^T (+ bias): our kernel on GGUF blocks, or oneDNN on the dense copy.
void project(const Proj& p, const float* x, int64_t ldx, int64_t T, int64_t isa, Out& out) {
  if (p.dense()) {
    static const auto linear =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, c10::string_view,
                              c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
    const at::Tensor xt = at::from_blob(const_cast<float*>(x), {T, p.K}, {ldx, 1}, at::TensorOptions().dtype(at::kFloat));
    out.owner = linear.call(xt, p.packed, p.dense_bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::string_view(""));
    out.data = out.owner.data_ptr<float>();
    return;
  }
  float* o = out.take(T * p.N);
  for (int64_t i = 0, col = 0; i < p.num_parts; col += p.parts[i++].N) {  // each part into its columns of o
    const Part& q = p.parts[i];
    run_matmul(Job{x, ldx, T, q.blocks, q.N, q.row_bytes, p.K, o + col, p.N, q.qtype, q.scales}, isa);
  }
  if (p.bias)
    at::parallel_for(0, T, grain(p.N), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t n = 0; n < p.N; ++n) o[t * p.N + n] += p.bias[n];
    });
}

// Buffers a call reuses from layer to layer.
struct Scratch {
  Out x, act;    // normed rows [T, E]; silu(g) * u [T, I]
  Out qkv, y, g;  // projections: qkv [T, N], o and down [T, E], gate/up [T, 2I]
};

// y = w * (x * rsqrt(mean(x^2) + eps)) for one row of E values (y may be x)
inline void rms_norm_row(const float* xr, int64_t E, const float* w, float eps, float* y) {
  float lanes[16] = {};  // 16 partial sums, as a vectorized reduction keeps them
  for (int64_t e = 0; e < E; ++e) lanes[e % 16] += xr[e] * xr[e];
  float ss = 0.f;
  for (float l : lanes) ss += l;
  const float r = 1.f / std::sqrt(ss / float(E) + eps);
  for (int64_t e = 0; e < E; ++e) {
    const float n = xr[e] * r;
    y[e] = w[e] * n;
  }
}

// y[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)) for T rows of E values (y may be x)
void rms_norm(const float* x, int64_t T, int64_t E, const float* w, float eps, float* y) {
  at::parallel_for(0, T, grain(E), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rms_norm_row(x + t * E, E, w, eps, y + t * E);
  });
}

// What a family adds to the Llama layer (nullptr / false: absent). Gemma's norms take (1 + w),
// which the caller passes as the weight: the same fp32 product.
struct LayerExtras {
  const float* q_norm = nullptr;     // [D]: every q head, before RoPE (Qwen3, Gemma 3)
  const float* k_norm = nullptr;     // [D]: every k head
  const float* attn_norm = nullptr;  // [E]: on the o projection's output, before the residual (Gemma)
  const float* mlp_norm = nullptr;   // [E]: on the MLP's output, before the residual (Gemma)
  bool gelu = false;                 // GeGLU (tanh) instead of SwiGLU
};

// h[T, E] += y[T, E]
void add_rows(float* h, const float* y, int64_t T, int64_t E) {
  at::parallel_for(0, T, grain(E), [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0 * E; i < t1 * E; ++i) h[i] += y[i];
  });
}

// x[0..R) of one head rotated in place: x*cos + rotate_half(x)*sin, rotate_half = (-x2, x1)
__attribute__((optimize("fp-contract=off"))) void rope_head(float* x, const float* c, const float* s, int64_t R) {
  const int64_t half = R / 2;
  float tmp[512];
  std::memcpy(tmp, x, R * sizeof(float));
  for (int64_t j = 0; j < half; ++j) x[j] = tmp[j] * c[j] + (-tmp[j + half]) * s[j];
  for (int64_t j = half; j < R; ++j) x[j] = tmp[j] * c[j] + tmp[j - half] * s[j];
}

// x = rms_norm(h); qkv = x . W^T (+ b) [T, N] into sc.qkv; the q and k heads of each row
// normed (where the layer has q/k norms), then rotated (the first heads + kv_heads heads)
void attn_in_raw(const float* h, int64_t T, const float* norm_w, float eps, const Proj& p, const float* cos,
                 const float* sin, int64_t R, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t isa,
                 Scratch& sc, const LayerExtras& ex = {}) {
  float* x = sc.x.take(T * p.K);
  rms_norm(h, T, p.K, norm_w, eps, x);
  project(p, x, p.K, T, isa, sc.qkv);
  float* out = sc.qkv.data;
  at::parallel_for(0, T, grain(p.N), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t hd = 0; hd < heads + kv_heads; ++hd) {  // q heads, then k heads (v is neither)
        float* x = out + t * p.N + hd * head_dim;
        const float* qk_norm = hd < heads ? ex.q_norm : ex.k_norm;
        if (qk_norm) rms_norm_row(x, head_dim, qk_norm, eps, x);
        rope_head(x, cos + t * R, sin + t * R, R);
      }
  });
}

void check_rope(const at::Tensor& cos, const at::Tensor& sin, int64_t T, int64_t head_dim) {
  const int64_t R = cos.size(-1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == T && sin.sizes() == cos.sizes() &&
                  R <= head_dim && R % 2 == 0 && R <= 512,
              "stepwise_gguf: cos/sin must be float32 [T, R], R even and <= head_dim");
}

// h [T, E], norm_w [E], cos/sin [T, R] (rows for the tokens' positions), qkv [T, (H + 2 KVH) D] (written)
void attn_in(const at::Tensor& h, const at::Tensor& norm_w, double eps, const at::Tensor& blocks, int64_t qtype,
             const c10::optional<at::Tensor>& bias, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
             int64_t kv_heads, int64_t head_dim, int64_t isa, const at::Tensor& qkv,
             const c10::optional<at::Tensor>& scales) {
  const Proj p = proj_of(blocks, qtype, bias, isa, scales);
  const int64_t T = h.size(0), E = p.K;
  for (const at::Tensor* t : {&h, &norm_w, &qkv})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "stepwise_gguf.attn_in: float32 contiguous tensors only");
  TORCH_CHECK(h.dim() == 2 && h.size(1) == E && norm_w.numel() == E, "stepwise_gguf.attn_in: h must be [T, ", E, "]");
  TORCH_CHECK(p.N == (heads + 2 * kv_heads) * head_dim && qkv.dim() == 2 && qkv.size(0) == T && qkv.size(1) == p.N,
              "stepwise_gguf.attn_in: qkv must be [T, (heads + 2 kv_heads) head_dim] = [T, ", p.N, "]");
  check_rope(cos, sin, T, head_dim);
  Scratch sc;
  attn_in_raw(h.data_ptr<float>(), T, norm_w.data_ptr<float>(), float(eps), p, cos.data_ptr<float>(),
              sin.data_ptr<float>(), cos.size(-1), heads, kv_heads, head_dim, isa, sc);
  std::memcpy(qkv.data_ptr<float>(), sc.qkv.data, T * p.N * sizeof(float));
}

// h += attn . Wo^T (+ b); x = rms_norm(h); g, u = x . Wgu^T (+ b); h += (silu(g) * u) . Wd^T (+ b).
// Gemma (extras): each of the two residual branches is normed before it is added, and GeGLU.
void attn_out_mlp_raw(float* hp, int64_t T, const float* attn, const Proj& o, const float* norm_w, float eps,
                      const Proj& gu, const Proj& down, int64_t isa, Scratch& sc, const LayerExtras& ex = {}) {
  const int64_t E = o.N, I = down.K;
  project(o, attn, o.K, T, isa, sc.y);
  if (ex.attn_norm) rms_norm(sc.y.data, T, E, ex.attn_norm, eps, sc.y.data);
  add_rows(hp, sc.y.data, T, E);
  float* x = sc.x.take(T * E);
  rms_norm(hp, T, E, norm_w, eps, x);
  project(gu, x, E, T, isa, sc.g);  // [T, 2I]: gate, then up
  float *g = sc.g.data, *a = sc.act.take(T * I);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor act = at::from_blob(a, {T, I}, f32);
  const at::Tensor gate = at::from_blob(g, {T, I}, {2 * I, 1}, f32);
  if (ex.gelu)
    at::gelu_out(act, gate, "tanh");
  else
    at::silu_out(act, gate);
  at::parallel_for(0, T, grain(I), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < I; ++i) a[t * I + i] *= g[t * 2 * I + I + i];
  });
  project(down, a, I, T, isa, sc.y);
  if (ex.mlp_norm) rms_norm(sc.y.data, T, E, ex.mlp_norm, eps, sc.y.data);
  add_rows(hp, sc.y.data, T, E);
}

void check_chain(const Proj& o, const Proj& gu, const Proj& down, int64_t E, int64_t attn_width) {
  TORCH_CHECK(o.N == E && attn_width == o.K && gu.K == E && gu.N == 2 * down.K && down.N == E,
              "stepwise_gguf.attn_out_mlp: shapes do not chain (h [T, E], attn [T, H D], gate/up [2I, E], down [E, I])");
}

// h [T, E] (updated in place), attn [T, H*D]; the MLP is gate/up fused, [2I] rows, then down [E]
void attn_out_mlp(const at::Tensor& h, const at::Tensor& attn, const at::Tensor& o_blocks, int64_t o_qtype,
                  const c10::optional<at::Tensor>& o_bias, const at::Tensor& norm_w, double eps,
                  const at::Tensor& gu_blocks, int64_t gu_qtype, const c10::optional<at::Tensor>& gu_bias,
                  const at::Tensor& down_blocks, int64_t down_qtype, const c10::optional<at::Tensor>& down_bias,
                  int64_t isa, const c10::List<c10::optional<at::Tensor>>& scales) {
  TORCH_CHECK(scales.size() == 3, "stepwise_gguf.attn_out_mlp: scales must hold one entry (or None) for o, gate/up, down");
  const Proj o = proj_of(o_blocks, o_qtype, o_bias, isa, scales.get(0)),
             gu = proj_of(gu_blocks, gu_qtype, gu_bias, isa, scales.get(1)),
             down = proj_of(down_blocks, down_qtype, down_bias, isa, scales.get(2));
  for (const at::Tensor* t : {&h, &attn, &norm_w})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "stepwise_gguf.attn_out_mlp: float32 contiguous tensors only");
  TORCH_CHECK(h.dim() == 2 && attn.dim() == 2 && attn.size(0) == h.size(0) && norm_w.numel() == h.size(1),
              "stepwise_gguf.attn_out_mlp: h [T, E], attn [T, H D] and norm_w [E] do not match");
  check_chain(o, gu, down, h.size(1), attn.size(1));
  Scratch sc;
  attn_out_mlp_raw(h.data_ptr<float>(), h.size(0), attn.data_ptr<float>(), o, norm_w.data_ptr<float>(), float(eps), gu,
                   down, isa, sc);
}

// Every layer of a step in one call, with the CPU attention kernel (stepwise_cpu::paged_attention,
// engine/attention/csrc) between the halves. Per layer l, norms[2 l ..] = input norm,
// post-attention norm; parts[4 l ..] = how many weights each of qkv, o, gate/up, down stacks
// (one, or up to MAX_PARTS of GGUF blocks whose types differ); weights, types and block_scales =
// those weights in that order, each GGUF blocks with its ggml type and fp32 scale pairs (or
// None), or a prepacked weight of type DENSE (alone in its projection); biases[4 l ..] = the
// four projections' biases; cos/sin[l] = the layer's rotary rows [T, R]; scale/window/softcap[l]
// = its attention; extra_norms[4 l ..] = the layer's q norm, k norm, norm of the attention output
// and norm of the MLP output (each None where the family has none; Gemma's as 1 + w), and
// activation 0 = SwiGLU, 1 = GeGLU (tanh).
// kv [L, 2, blocks, block_size, KVH, D] (float32, or float16 / bfloat16: kv_cache_dtype);
// slot_mapping, tiles and block_tables as the attention kernel takes them (CpuPlan).
void layers(const at::Tensor& h, at::TensorList norms, at::TensorList weights, at::IntArrayRef types,
            at::IntArrayRef parts, const c10::List<c10::optional<at::Tensor>>& biases, at::TensorList cos,
            at::TensorList sin, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, int64_t isa,
            const at::Tensor& kv, const at::Tensor& slot_mapping, const at::Tensor& tiles,
            const at::Tensor& block_tables, at::ArrayRef<double> scale, at::IntArrayRef window,
            at::ArrayRef<double> softcap, const c10::List<c10::optional<at::Tensor>>& block_scales,
            const c10::List<c10::optional<at::Tensor>>& extra_norms, int64_t activation) {
  static const auto attention =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("stepwise_cpu::paged_attention", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                      double)>();
  const int64_t L = kv.size(0), T = h.size(0), E = h.size(1), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  TORCH_CHECK(int64_t(norms.size()) == 2 * L && int64_t(parts.size()) == 4 * L && int64_t(biases.size()) == 4 * L &&
                  int64_t(extra_norms.size()) == 4 * L && int64_t(cos.size()) == L && int64_t(sin.size()) == L &&
                  int64_t(scale.size()) == L && int64_t(window.size()) == L && int64_t(softcap.size()) == L,
              "stepwise_gguf.layers: per-layer lists must hold 2/4/4/4/1 entries for each of the ", L, " layers");
  int64_t num_weights = 0;
  for (int64_t n : parts) {
    TORCH_CHECK(n >= 1 && n <= MAX_PARTS, "stepwise_gguf.layers: a projection stacks 1 to ", MAX_PARTS, " weights");
    num_weights += n;
  }
  TORCH_CHECK(int64_t(weights.size()) == num_weights && int64_t(types.size()) == num_weights &&
                  int64_t(block_scales.size()) == num_weights,
              "stepwise_gguf.layers: weights, types and block_scales must hold one entry per part (", num_weights, ")");
  TORCH_CHECK(activation == 0 || activation == 1, "stepwise_gguf.layers: activation must be 0 (SwiGLU) or 1 (GeGLU)");
  const auto kv_type = kv.scalar_type();  // the attention kernel stores and reads it
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.is_contiguous() && h.dim() == 2 &&
                  (kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16) && kv.dim() == 6 &&
                  kv.size(1) == 2 && kv.size(4) == kv_heads && kv.size(5) == head_dim,
              "stepwise_gguf.layers: h must be contiguous float32 [T, E], kv float32, float16 or bfloat16 "
              "[L, 2, blocks, block_size, KVH, D]");
  const at::Tensor out = at::empty({T, heads, head_dim}, h.options());
  Scratch sc;
  at::Tensor q, k, v;
  const float* viewed = nullptr;  // the qkv buffer q/k/v view (oneDNN returns a new one every layer)
  int64_t next = 0;               // the next projection's first weight
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor *norm1 = &norms[2 * l], *norm2 = &norms[2 * l + 1];
    const auto proj = [&](int i) {
      Proj p;
      for (int64_t j = 0; j < parts[4 * l + i]; ++j, ++next) add_part(p, weights[next], types[next], isa, block_scales.get(next));
      set_bias(p, biases.get(4 * l + i));
      return p;
    };
    const Proj pqkv = proj(0), o = proj(1), gu = proj(2), down = proj(3);
    TORCH_CHECK(pqkv.K == E && pqkv.N == q_size + 2 * kv_size && norm1->numel() == E && norm2->numel() == E &&
                    norm1->scalar_type() == at::kFloat && norm2->scalar_type() == at::kFloat && norm1->is_contiguous() &&
                    norm2->is_contiguous(), "stepwise_gguf.layers: layer ", l, "'s qkv projection or norms do not fit h");
    check_chain(o, gu, down, E, q_size);
    check_rope(cos[l], sin[l], T, head_dim);
    LayerExtras ex;
    ex.gelu = activation == 1;
    const float** slots[4] = {&ex.q_norm, &ex.k_norm, &ex.attn_norm, &ex.mlp_norm};
    for (int i = 0; i < 4; ++i) {
      const c10::optional<at::Tensor> norm = extra_norms.get(4 * l + i);
      if (!norm.has_value()) continue;
      TORCH_CHECK(norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->numel() == (i < 2 ? head_dim : E),
                  "stepwise_gguf.layers: layer ", l, "'s extra norm ", i, " must be contiguous float32 [",
                  i < 2 ? head_dim : E, "]");
      *slots[i] = norm->data_ptr<float>();
    }
    attn_in_raw(h.data_ptr<float>(), T, norm1->data_ptr<float>(), float(eps), pqkv, cos[l].data_ptr<float>(),
                sin[l].data_ptr<float>(), cos[l].size(-1), heads, kv_heads, head_dim, isa, sc, ex);
    if (sc.qkv.data != viewed) {  // q/k/v views of this layer's qkv [T, (H + 2 KVH) D]: the kernel's reused
      const at::Tensor qkv = sc.qkv.owner.defined() ? sc.qkv.owner : at::from_blob(sc.qkv.data, {T, pqkv.N}, h.options());
      q = qkv.narrow(1, 0, q_size).view({T, heads, head_dim});
      k = qkv.narrow(1, q_size, kv_size).view({T, kv_heads, head_dim});
      v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads, head_dim});
      viewed = sc.qkv.data;
    }
    const at::Tensor layer_kv = kv.select(0, l);
    attention.call(q, k, v, layer_kv.select(0, 0), layer_kv.select(0, 1), slot_mapping, tiles, block_tables, out,
                   scale[l], window[l], softcap[l]);
    attn_out_mlp_raw(h.data_ptr<float>(), T, out.data_ptr<float>(), o, norm2->data_ptr<float>(), float(eps), gu, down, isa,
                     sc, ex);
  }
}
