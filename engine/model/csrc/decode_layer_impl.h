// A plain (Llama-arithmetic) decoder layer's work around attention, for steps of few rows with
// every projection on GGUF blocks: two calls a layer instead of ~45 small ATen ops from Python.
// quant_matmul.cpp includes this file once, after run_matmul(), inside its anonymous namespace.
//
//   attn_in:      x = rms_norm(h); qkv = x . Wqkv^T (+ b); RoPE (rotate-half) on q and k, in place
//   attn_out_mlp: h += attn . Wo^T (+ b); x = rms_norm(h); g, u = x . Wgu^T (+ b);
//                 h += (silu(g) * u) . Wd^T (+ b)
//
// Each elementwise step keeps transformers' fp32 rounding order: x * rsqrt(mean(x^2) + eps) is
// rounded before the weight multiplies it; RoPE is x*cos + rotate_half(x)*sin; silu is torch's
// own kernel (at::silu_out), then one rounded multiply by u. Only the order of the additions in
// the norm's mean and in the products differs from the op-by-op path.

// A projection's blocks, as the Python QuantLinear holds them.
struct Proj {
  const uint8_t* blocks;
  int64_t N, row_bytes, K;
  int qtype;
  const float* bias;  // [N] or nullptr
};

Proj proj_of(const at::Tensor& blocks, int64_t qtype, const c10::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0, "stepwise_gguf: unsupported ggml type ", qtype);
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) % block_bytes(int(qtype)) == 0,
              "stepwise_gguf: blocks rows are not whole blocks of type ", qtype);
  const int64_t K = blocks.size(1) / block_bytes(int(qtype)) * 32;
  check_blocks(blocks, qtype, K, isa);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == blocks.size(0),
                "stepwise_gguf: a bias must be contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  return Proj{blocks.data_ptr<uint8_t>(), blocks.size(0), blocks.size(1), K, int(qtype), b};
}

// out[T, N] = x[T, K] . dequant(W)^T (+ bias)
void project(const Proj& p, const float* x, int64_t ldx, int64_t T, float* out, int64_t ldo, int64_t isa) {
  run_matmul(Job{x, ldx, T, p.blocks, p.N, p.row_bytes, p.K, out, ldo, p.qtype}, isa);
  if (p.bias)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < p.N; ++n) out[t * ldo + n] += p.bias[n];
}

// y[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)) for T rows of E values
void rms_norm(const float* x, int64_t T, int64_t E, const float* w, float eps, float* y) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * E;
    float lanes[16] = {};  // 16 partial sums, as a vectorized reduction keeps them
    for (int64_t e = 0; e < E; ++e) lanes[e % 16] += xr[e] * xr[e];
    float ss = 0.f;
    for (float l : lanes) ss += l;
    const float r = 1.f / std::sqrt(ss / float(E) + eps);
    for (int64_t e = 0; e < E; ++e) {
      const float n = xr[e] * r;
      y[t * E + e] = w[e] * n;
    }
  }
}

// x[0..R) of one head rotated in place: x*cos + rotate_half(x)*sin, rotate_half = (-x2, x1)
__attribute__((optimize("fp-contract=off"))) void rope_head(float* x, const float* c, const float* s, int64_t R) {
  const int64_t half = R / 2;
  float tmp[512];
  std::memcpy(tmp, x, R * sizeof(float));
  for (int64_t j = 0; j < half; ++j) x[j] = tmp[j] * c[j] + (-tmp[j + half]) * s[j];
  for (int64_t j = half; j < R; ++j) x[j] = tmp[j] * c[j] + tmp[j - half] * s[j];
}

// h [T, E], norm_w [E], cos/sin [T, R] (rows for the tokens' positions), qkv [T, (H + 2 KVH) D] (written)
void attn_in(const at::Tensor& h, const at::Tensor& norm_w, double eps, const at::Tensor& blocks, int64_t qtype,
             const c10::optional<at::Tensor>& bias, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
             int64_t kv_heads, int64_t head_dim, int64_t isa, const at::Tensor& qkv) {
  const Proj p = proj_of(blocks, qtype, bias, isa);
  const int64_t T = h.size(0), E = p.K, R = cos.size(-1);
  for (const at::Tensor* t : {&h, &norm_w, &cos, &sin, &qkv})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "stepwise_gguf.attn_in: float32 contiguous tensors only");
  TORCH_CHECK(h.dim() == 2 && h.size(1) == E && norm_w.numel() == E, "stepwise_gguf.attn_in: h must be [T, ", E, "]");
  TORCH_CHECK(p.N == (heads + 2 * kv_heads) * head_dim && qkv.dim() == 2 && qkv.size(0) == T && qkv.size(1) == p.N,
              "stepwise_gguf.attn_in: qkv must be [T, (heads + 2 kv_heads) head_dim] = [T, ", p.N, "]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && sin.sizes() == cos.sizes() && R <= head_dim && R % 2 == 0 &&
                  R <= 512, "stepwise_gguf.attn_in: cos/sin must be [T, R], R even and <= head_dim");
  std::vector<float> x(T * E);
  rms_norm(h.data_ptr<float>(), T, E, norm_w.data_ptr<float>(), float(eps), x.data());
  float* out = qkv.data_ptr<float>();
  project(p, x.data(), E, T, out, p.N, isa);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t hd = 0; hd < heads + kv_heads; ++hd)  // q heads, then k heads (v is not rotated)
      rope_head(out + t * p.N + hd * head_dim, cos.data_ptr<float>() + t * R, sin.data_ptr<float>() + t * R, R);
}

// h [T, E] (updated in place), attn [T, H*D]; the MLP is gate/up fused, [2I] rows, then down [E]
void attn_out_mlp(const at::Tensor& h, const at::Tensor& attn, const at::Tensor& o_blocks, int64_t o_qtype,
                  const c10::optional<at::Tensor>& o_bias, const at::Tensor& norm_w, double eps,
                  const at::Tensor& gu_blocks, int64_t gu_qtype, const c10::optional<at::Tensor>& gu_bias,
                  const at::Tensor& down_blocks, int64_t down_qtype, const c10::optional<at::Tensor>& down_bias,
                  int64_t isa) {
  const Proj o = proj_of(o_blocks, o_qtype, o_bias, isa), gu = proj_of(gu_blocks, gu_qtype, gu_bias, isa),
             down = proj_of(down_blocks, down_qtype, down_bias, isa);
  const int64_t T = h.size(0), E = o.N, I = down.K;
  for (const at::Tensor* t : {&h, &attn, &norm_w})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "stepwise_gguf.attn_out_mlp: float32 contiguous tensors only");
  TORCH_CHECK(h.dim() == 2 && h.size(1) == E && attn.dim() == 2 && attn.size(0) == T && attn.size(1) == o.K &&
                  norm_w.numel() == E && gu.K == E && gu.N == 2 * I && down.N == E,
              "stepwise_gguf.attn_out_mlp: shapes do not chain (h [T, E], attn [T, H D], gate/up [2I, E], down [E, I])");
  float* hp = h.data_ptr<float>();
  std::vector<float> y(T * E), x(T * E), g(T * 2 * I), a(T * I);
  project(o, attn.data_ptr<float>(), o.K, T, y.data(), E, isa);
  for (int64_t i = 0; i < T * E; ++i) hp[i] += y[i];
  rms_norm(hp, T, E, norm_w.data_ptr<float>(), float(eps), x.data());
  project(gu, x.data(), E, T, g.data(), 2 * I, isa);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor act = at::from_blob(a.data(), {T, I}, f32);
  at::silu_out(act, at::from_blob(g.data(), {T, I}, {2 * I, 1}, f32));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) a[t * I + i] *= g[t * 2 * I + I + i];
  project(down, a.data(), I, T, y.data(), E, isa);
  for (int64_t i = 0; i < T * E; ++i) hp[i] += y[i];
}
