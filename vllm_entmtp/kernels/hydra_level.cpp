// One level of grounded one-layer Hydra heads for at most 4 paths, in one call: the head's block (its two linear
// maps fused into one [2H, (P+1)H] weight, R x + b_R | W x + b_W, then R x + b_R + SiLU(W x + b_W)) on
// x = [h ; e(y_1) ; ... ; e(y_P)], the draft lm_head, then each path's top-k draft tokens and, when asked, the top-1
// probability (softmax over the draft vocabulary). The arithmetic of torch's layers on the same weights, in another
// order and in float32 (bfloat16 values are widened as they are read; the head's hidden state is rounded to the
// dtype before the lm_head, as in torch's path, but the block's output and the logits are not, where torch's
// bfloat16 path rounds them and so ties more logits): a draft token can differ at a near-tie, the output never
// (verification decides).
//
// Why one call: right after the target's forward a torch operator's first call costs tens of microseconds (its code
// is out of the caches), and a level took about ten of them around its two matrix products. The products read each
// weight row once for all paths, rows split over torch's threads (at::parallel_for). AVX-512F, or AVX2 with FMA
// (simd.h; the AVX512-BF16 products are AVX-512's only); float32 or bfloat16; hidden size a multiple of 16. Built
// at start-up by vllm_entmtp/hydra_kernel.py; benchmarks/hydra_level.py times it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <pybind11/stl.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

// Rows ahead whose weights are prefetched while a group of 4 is multiplied (up to the last of the thread's rows).
constexpr int PREFETCH_ROWS = 8;

// Y[n, r] = Wt[r, :] . X[n, :] (+ bias[r]) for rows r in [r0, r1) and NR inputs; `in` a multiple of 16.
template <int NR, typename T>
static void rows_times(const T* Wt, int64_t in, const float* X, const T* bias, float* Y, int64_t ystride, int64_t r0,
                       int64_t r1) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    vf acc[4][NR];
    for (int i = 0; i < 4; ++i)
      for (int n = 0; n < NR; ++n) acc[i][n] = vzero();
    const T* w0 = Wt + r * in;
    const T* wp[4];  // the rows PREFETCH_ROWS ahead, within this thread's rows
    for (int i = 0; i < 4; ++i) wp[i] = Wt + std::min(r + i + PREFETCH_ROWS, r1 - 1) * in;
    for (int64_t j = 0; j < in; j += W) {
      vf x[NR];
      for (int n = 0; n < NR; ++n) x[n] = vload(X + n * in + j);
      for (int i = 0; i < 4; ++i) {
        if (((j * (int64_t)sizeof(T)) & 63) == 0) _mm_prefetch((const char*)(wp[i] + j), _MM_HINT_T0);
        const vf w = vload(w0 + i * in + j);
        for (int n = 0; n < NR; ++n) acc[i][n] = vfmadd(w, x[n], acc[i][n]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      const float b = bias ? ld1(bias + r + i) : 0.f;
      for (int n = 0; n < NR; ++n) Y[n * ystride + r + i] = vsum(acc[i][n]) + b;
    }
  }
  for (; r < r1; ++r) {
    vf acc[NR];
    for (int n = 0; n < NR; ++n) acc[n] = vzero();
    for (int64_t j = 0; j < in; j += W) {
      const vf w = vload(Wt + r * in + j);
      for (int n = 0; n < NR; ++n) acc[n] = vfmadd(w, vload(X + n * in + j), acc[n]);
    }
    const float b = bias ? ld1(bias + r) : 0.f;
    for (int n = 0; n < NR; ++n) Y[n * ystride + r] = vsum(acc[n]) + b;
  }
}

#if defined(ENTMTP_AVX512)
// rows_times for bfloat16 weights on CPUs with AVX512-BF16: X is given in bfloat16 (Xb [NR, in], rounded once) and
// each 32 weights take one load and one _mm512_dpbf16_ps per path; `in` a multiple of 32.
template <int NR>
__attribute__((target("avx512f,avx512bf16"))) static void rows_times_dp(const uint16_t* Wt, int64_t in,
                                                                         const uint16_t* Xb, const uint16_t* bias,
                                                                         float* Y, int64_t ystride, int64_t r0,
                                                                         int64_t r1) {
  for (int64_t r = r0; r < r1; r += 4) {
    const int rows = (int)std::min<int64_t>(4, r1 - r);
    __m512 acc[4][NR];
    for (int i = 0; i < 4; ++i)
      for (int n = 0; n < NR; ++n) acc[i][n] = _mm512_setzero_ps();
    const uint16_t* w0 = Wt + r * in;
    const uint16_t* wp[4];  // the rows PREFETCH_ROWS ahead, within this thread's rows
    for (int i = 0; i < 4; ++i) wp[i] = Wt + std::min(r + i + PREFETCH_ROWS, r1 - 1) * in;
    if (rows == 4) {
      for (int64_t j = 0; j < in; j += 32) {
        __m512bh x[NR];
        for (int n = 0; n < NR; ++n) x[n] = (__m512bh)_mm512_loadu_si512(Xb + n * in + j);
        for (int i = 0; i < 4; ++i) {
          _mm_prefetch((const char*)(wp[i] + j), _MM_HINT_T0);
          const __m512bh w = (__m512bh)_mm512_loadu_si512(w0 + i * in + j);
          for (int n = 0; n < NR; ++n) acc[i][n] = _mm512_dpbf16_ps(acc[i][n], w, x[n]);
        }
      }
    } else {
      for (int i = 0; i < rows; ++i)
        for (int64_t j = 0; j < in; j += 32) {
          const __m512bh w = (__m512bh)_mm512_loadu_si512(w0 + i * in + j);
          for (int n = 0; n < NR; ++n)
            acc[i][n] = _mm512_dpbf16_ps(acc[i][n], w, (__m512bh)_mm512_loadu_si512(Xb + n * in + j));
        }
    }
    for (int i = 0; i < rows; ++i) {
      const float b = bias ? ld1(bias + r + i) : 0.f;
      for (int n = 0; n < NR; ++n) Y[n * ystride + r + i] = _mm512_reduce_add_ps(acc[i][n]) + b;
    }
  }
}

static bool has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}
#endif  // ENTMTP_AVX512

// f(std::integral_constant<int, N>{}, r0, r1) for N in 1..4 over the row blocks [r0, r1) of 16 rows of `out`,
// the blocks split over torch's threads.
template <typename F>
static void over_row_blocks(int64_t out, int64_t N, const F& f) {
  at::parallel_for(0, (out + 15) / 16, 8, [&](int64_t b0, int64_t b1) {
    const int64_t r0 = b0 * 16, r1 = std::min(out, b1 * 16);
    switch (N) {
      case 1: f(std::integral_constant<int, 1>{}, r0, r1); break;
      case 2: f(std::integral_constant<int, 2>{}, r0, r1); break;
      case 3: f(std::integral_constant<int, 3>{}, r0, r1); break;
      default: f(std::integral_constant<int, 4>{}, r0, r1); break;
    }
  });
}

// Y [N, out] = X [N, in] W^T (+ bias) for N in 1..4.
template <typename T>
static void matmul_small(const T* W, int64_t out, int64_t in, const float* X, int64_t N, const T* bias, float* Y) {
#if defined(ENTMTP_AVX512)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (in % 32 == 0 && has_avx512_bf16()) {
      static thread_local std::vector<uint16_t> xb;
      xb.resize(N * in);
      for (int64_t i = 0; i < N * in; ++i) xb[i] = to_bf16(X[i]);
      const uint16_t* xp = xb.data();  // xb is this thread's: the workers read it through the pointer
      over_row_blocks(out, N, [&](auto nr, int64_t r0, int64_t r1) {
        rows_times_dp<decltype(nr)::value>(W, in, xp, bias, Y, out, r0, r1);
      });
      return;
    }
  }
#endif
  over_row_blocks(out, N, [&](auto nr, int64_t r0, int64_t r1) {
    rows_times<decltype(nr)::value>(W, in, X, bias, Y, out, r0, r1);
  });
}

// sum over c of exp(l[c] - m), where m >= every l[c]
static double sum_exp(const float* l, int64_t n, float m) {
  vf acc = vzero();
  const vf mz = vset1(m);
  int64_t c = 0;
  for (; c + W <= n; c += W) acc = vadd(acc, vexp(vsub(vload(l + c), mz)));
  double s = vsum(acc);
  for (; c < n; ++c) s += std::exp((double)(l[c] - m));
  return s;
}

using Result = std::pair<std::vector<std::vector<int64_t>>, std::vector<double>>;

template <typename T>
static Result level_impl(const torch::Tensor& hidden, const torch::Tensor& path_emb, const torch::Tensor& w_block,
                         const torch::Tensor& b_block, const torch::Tensor& w_lm, const int64_t* token_ids,
                         int64_t topk, bool probs) {
  const int64_t N = hidden.size(0), H = hidden.size(1), P = path_emb.size(1), in = (P + 1) * H;
  const int64_t DV = w_lm.size(0);
  // buffers kept between calls (a fresh one of the logits' size would be mapped, and its pages faulted in, per call)
  static thread_local std::vector<float> x, y, h, logits;
  x.resize(N * in);  // [h ; e(y_1) ; ... ; e(y_P)] in float32
  const T* hp = (const T*)hidden.data_ptr();
  const T* ep = (const T*)path_emb.data_ptr();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < H; ++j) x[n * in + j] = ld1(hp + n * H + j);
    for (int64_t j = 0; j < P * H; ++j) x[n * in + H + j] = ld1(ep + n * P * H + j);
  }
  y.resize(N * 2 * H);
  matmul_small<T>((const T*)w_block.data_ptr(), 2 * H, in, x.data(), N, (const T*)b_block.data_ptr(), y.data());
  h.resize(N * H);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < H; ++j) {
      const float r = y[n * 2 * H + j], w = y[n * 2 * H + H + j];
      h[n * H + j] = r + w / (1.f + std::exp(-w));
      if constexpr (std::is_same_v<T, uint16_t>) {  // the lm_head reads it in bfloat16, as torch's path does
        const uint32_t u = (uint32_t)to_bf16(h[n * H + j]) << 16;
        std::memcpy(&h[n * H + j], &u, 4);
      }
    }
  logits.resize(N * DV);
  matmul_small<T>((const T*)w_lm.data_ptr(), DV, H, h.data(), N, nullptr, logits.data());
  Result out;
  out.first.resize(N);
  std::vector<std::pair<float, int64_t>> best;
  best.reserve(topk + 1);
  for (int64_t n = 0; n < N; ++n) {
    const float* l = &logits[n * DV];
    best.clear();  // the top-k, best first; a tie keeps the lower column first
    for (int64_t c = 0; c < DV; ++c) {
      if ((int64_t)best.size() == topk && c % W == 0 && c + W <= DV &&
          !vany_gt(vload(l + c), vset1(best.back().first))) {
        c += W - 1;  // none of these W enters the top-k
        continue;
      }
      const float v = l[c];
      if ((int64_t)best.size() == topk && !(v > best.back().first)) continue;
      auto it = std::upper_bound(best.begin(), best.end(), v,
                                 [](float a, const std::pair<float, int64_t>& b) { return a > b.first; });
      best.insert(it, {v, c});
      if ((int64_t)best.size() > topk) best.pop_back();
    }
    for (const auto& b : best) out.first[n].push_back(token_ids ? token_ids[b.second] : b.second);
    if (probs) out.second.push_back(1.0 / sum_exp(l, DV, best[0].first));
  }
  return out;
}

// -> (N lists of the top-k token ids, best first; N top-1 probabilities, or none when not `probs`).
// hidden [N, H]; path_emb [N, P, H] (the input embeddings of the path's tokens, bonus token first); w_block
// [2H, (P+1)H], b_block [2H]; w_lm [DV, H]; token_ids [DV] int64 (column -> token id; empty: the column is the id).
Result hydra_level(torch::Tensor hidden, torch::Tensor path_emb, torch::Tensor w_block, torch::Tensor b_block,
                   torch::Tensor w_lm, torch::Tensor token_ids, int64_t topk, bool probs) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) >= 1 && hidden.size(0) <= 4, "hidden: [N in 1..4, H]");
  const int64_t N = hidden.size(0), H = hidden.size(1);
  TORCH_CHECK(H % 16 == 0, "hidden size: a multiple of 16");
  TORCH_CHECK(path_emb.dim() == 3 && path_emb.size(0) == N && path_emb.size(2) == H, "path_emb: [N, P, H]");
  const int64_t in = (path_emb.size(1) + 1) * H;
  const auto dt = hidden.scalar_type();
  TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16, "float32 or bfloat16");
  for (const auto* t : {&hidden, &path_emb, &w_block, &b_block, &w_lm})
    TORCH_CHECK(t->scalar_type() == dt && t->is_contiguous() && t->device().is_cpu(),
                "hidden, path_emb and weights: one dtype, contiguous, on the CPU");
  TORCH_CHECK(w_block.dim() == 2 && w_block.size(0) == 2 * H && w_block.size(1) == in, "w_block: [2H, (P + 1) H]");
  TORCH_CHECK(b_block.dim() == 1 && b_block.size(0) == 2 * H, "b_block: [2H]");
  TORCH_CHECK(w_lm.dim() == 2 && w_lm.size(1) == H, "w_lm: [DV, H]");
  TORCH_CHECK(topk >= 1 && topk <= w_lm.size(0), "topk in [1, DV]");
  const int64_t* ids = nullptr;
  if (token_ids.numel()) {
    TORCH_CHECK(token_ids.scalar_type() == torch::kInt64 && token_ids.is_contiguous() && token_ids.dim() == 1
                && token_ids.size(0) == w_lm.size(0) && token_ids.device().is_cpu(),
                "token_ids: [DV] int64, contiguous, on the CPU");
    ids = token_ids.data_ptr<int64_t>();
  }
  if (dt == torch::kFloat32) return level_impl<float>(hidden, path_emb, w_block, b_block, w_lm, ids, topk, probs);
  return level_impl<uint16_t>(hidden, path_emb, w_block, b_block, w_lm, ids, topk, probs);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("hydra_level", &hydra_level,
        "one level of Hydra heads for at most 4 paths: top-k token ids, top-1 probability");
}
