// The attention of requests that verify draft tokens (2 or more query rows each; in such a step the requests of one
// row too), on vLLM's CPU paged KV cache in its ``vec`` layout (per block and KV head: K transposed ``[head_dim,
// block_size]``, then V ``[block_size, head_dim]``), causal. Each request's K/V blocks are read once for all its
// query rows and all query heads of a KV head, the dot-product and weighted-sum accumulators in registers. On the
// project's 2-core EPYC with AVX-512 (bfloat16, one thread, 16 requests, 300 tokens of context) two rows a request
// took 1.31x one row's time here and 1.39x in vLLM's kernel (1.30x and 1.54x at 1,000 tokens), and one row 0.76x
// vLLM's time (0.78x at 1,000): benchmarks/attention_rows.py --kernels vllm,entmtp. AVX-512F, or AVX2 with FMA
// (simd.h: the build's flags pick the vectors; the amx path below is AVX-512's only); float32 or bfloat16; head_dim
// 64 or 128; block size a multiple of 16. Built at start-up by vllm_entmtp/verify_attention.py. vLLM's ``amx``
// layout (bfloat16 on CPUs with AMX) has its own path below (multirow_attention_amx, AMX tiles).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

#include "simd.h"

// s[v][tc..tc+W) = q[v] . K[:, tc..tc+W) for VG query vectors
template <typename T, int D, int VG>
static inline void qk_group(const float* qf, const T* K, int64_t bs, int64_t nt, float* s, int64_t sstride) {
  for (int64_t tc = 0; tc < nt; tc += W) {
    vf acc[VG];
    for (int v = 0; v < VG; ++v) acc[v] = vzero();
    for (int d = 0; d < D; ++d) {
      const vf kz = vload(K + d * bs + tc);
      for (int v = 0; v < VG; ++v) acc[v] = vfmadd(vset1(qf[v * D + d]), kz, acc[v]);
    }
    for (int v = 0; v < VG; ++v) vstore(s + v * sstride + tc, acc[v]);
  }
}
template <typename T, int D>
static void qk(const float* qf, int64_t nq, const T* K, int64_t bs, int64_t nt, float* s) {
  int64_t v = 0;
  for (; v + 8 <= nq; v += 8) qk_group<T, D, 8>(qf + v * D, K, bs, nt, s + v * bs, bs);
  switch (nq - v) {
    case 1: qk_group<T, D, 1>(qf + v * D, K, bs, nt, s + v * bs, bs); break;
    case 2: qk_group<T, D, 2>(qf + v * D, K, bs, nt, s + v * bs, bs); break;
    case 3: qk_group<T, D, 3>(qf + v * D, K, bs, nt, s + v * bs, bs); break;
    case 4: qk_group<T, D, 4>(qf + v * D, K, bs, nt, s + v * bs, bs); break;
    case 5: qk_group<T, D, 5>(qf + v * D, K, bs, nt, s + v * bs, bs); break;
    case 6: qk_group<T, D, 6>(qf + v * D, K, bs, nt, s + v * bs, bs); break;
    case 7: qk_group<T, D, 7>(qf + v * D, K, bs, nt, s + v * bs, bs); break;
    default: break;
  }
}
// acc[v] += sum_t p[v][t] V[t] for VG query vectors, the head elements in chunks of C vectors (registers: VG * C
// accumulators and C values of V; AVX-512 has 32 of them, AVX2 16)
template <typename T, int D, int VG>
static inline void pv_group(const float* s, int64_t sstride, const T* V, int64_t nt, float* acc) {
  constexpr int DV = D / W, C = W == 16 ? DV : 4;
  for (int c0 = 0; c0 < DV; c0 += C) {
    vf a[VG][C];
    for (int v = 0; v < VG; ++v) for (int k = 0; k < C; ++k) a[v][k] = vload(acc + v * D + W * (c0 + k));
    for (int64_t t = 0; t < nt; ++t) {
      vf vz[C];
      for (int k = 0; k < C; ++k) vz[k] = vload(V + t * D + W * (c0 + k));
      for (int v = 0; v < VG; ++v) {
        const vf p = vset1(s[v * sstride + t]);
        for (int k = 0; k < C; ++k) a[v][k] = vfmadd(p, vz[k], a[v][k]);
      }
    }
    for (int v = 0; v < VG; ++v) for (int k = 0; k < C; ++k) vstore(acc + v * D + W * (c0 + k), a[v][k]);
  }
}
template <typename T, int D>
static void pv(const float* s, int64_t nq, int64_t bs, const T* V, int64_t nt, float* acc) {
  constexpr int G = W == 8 ? 2 : D == 64 ? 6 : 3;
  int64_t v = 0;
  for (; v + G <= nq; v += G) pv_group<T, D, G>(s + v * bs, bs, V, nt, acc + v * D);
  switch (nq - v) {
    case 1: pv_group<T, D, 1>(s + v * bs, bs, V, nt, acc + v * D); break;
    case 2: if constexpr (G > 2) pv_group<T, D, 2>(s + v * bs, bs, V, nt, acc + v * D); break;
    case 3: if constexpr (G > 3) pv_group<T, D, 3>(s + v * bs, bs, V, nt, acc + v * D); break;
    case 4: if constexpr (G > 4) pv_group<T, D, 4>(s + v * bs, bs, V, nt, acc + v * D); break;
    case 5: if constexpr (G > 5) pv_group<T, D, 5>(s + v * bs, bs, V, nt, acc + v * D); break;
    default: break;
  }
}

template <typename T, int D>
static void run(const T* q, int64_t qs0, int64_t qs1, const T* c, const int32_t* qsl, const int32_t* sl,
                const int32_t* tb, int64_t tbw, const int32_t* reqs, int64_t R, int64_t H, int64_t Hkv, int64_t bs,
                float scale, T* o, int64_t os0, int64_t os1) {
  const int64_t rep = H / Hkv;
  at::parallel_for(0, R * Hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t b = reqs[w / Hkv], g = w % Hkv;
      const int64_t q0 = qsl[b], n = qsl[b + 1] - q0, seq = sl[b], ctx = seq - n, nq = n * rep;
      if (n <= 0) continue;
      buf.assign(nq * D * 2 + nq * 2 + nq * bs, 0.f);
      float* qf = buf.data(); float* acc = qf + nq * D; float* m = acc + nq * D; float* l = m + nq; float* s = l + nq;
      for (int64_t i = 0; i < n; ++i) for (int64_t r = 0; r < rep; ++r) {
        const T* src = q + (q0 + i) * qs0 + (g * rep + r) * qs1;
        float* dst = qf + (i * rep + r) * D;
        for (int d = 0; d < D; ++d) dst[d] = ld1(src + d) * scale;
        m[i * rep + r] = -INFINITY;
      }
      const int64_t nblk = (seq + bs - 1) / bs;
      for (int64_t j = 0; j < nblk; ++j) {
        const T* blk = c + ((int64_t)tb[b * tbw + j] * Hkv + g) * 2 * bs * D;
        const int64_t t0 = j * bs, nt = std::min(bs, seq - t0);
        qk<T, D>(qf, nq, blk, bs, nt, s);
        for (int64_t v = 0; v < nq; ++v) {
          const int64_t lv = std::max<int64_t>(0, std::min(nt, ctx + v / rep + 1 - t0));
          float* sv = s + v * bs;
          if (lv == 0) { std::fill(sv, sv + nt, 0.f); continue; }
          vf mxv = vset1(m[v]);
          int64_t t = 0;
          for (; t + W <= lv; t += W) mxv = vmax(mxv, vload(sv + t));
          float mx = vmaxr(mxv);
          for (; t < lv; ++t) mx = std::max(mx, sv[t]);
          const vf mz = vset1(mx);
          vf sumv = vzero();
          for (t = 0; t < lv; t += W) {
            const vf e = vfirst(vexp(vsub(vload(sv + t), mz)), lv - t);
            vstore(sv + t, e);
            sumv = vadd(sumv, e);
          }
          for (t = lv; t < nt; ++t) sv[t] = 0.f;  // (the chunk loop may have zeroed some already)
          const float corr = m[v] == -INFINITY ? 0.f : std::exp(m[v] - mx);
          l[v] = l[v] * corr + vsum(sumv);
          m[v] = mx;
          float* av = acc + v * D;
          for (int d = 0; d < D; ++d) av[d] *= corr;
        }
        pv<T, D>(s, nq, bs, blk + D * bs, nt, acc);
      }
      for (int64_t i = 0; i < n; ++i) for (int64_t r = 0; r < rep; ++r) {
        const int64_t v = i * rep + r; const float inv = 1.f / l[v];
        T* dst = o + (q0 + i) * os0 + (g * rep + r) * os1;
        for (int d = 0; d < D; ++d) st1(dst + d, acc[v * D + d] * inv);
      }
    }
  });
}

// The checks both layouts' entry points share: head_dim, block size a multiple of ``block_multiple``, strides,
// one dtype for query, cache and out, int32 contiguous index tensors.
static void check_inputs(const torch::Tensor& query, const torch::Tensor& cache, const torch::Tensor& qsl,
                         const torch::Tensor& seq_lens, const torch::Tensor& table, const torch::Tensor& reqs,
                         const torch::Tensor& out, int64_t block_multiple) {
  const int64_t D = query.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head_dim 64 or 128");
  TORCH_CHECK((cache.size(2) / (2 * D)) % block_multiple == 0, "block size a multiple of ", block_multiple);
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && cache.is_contiguous() && table.is_contiguous(),
              "head_dim contiguous, cache and table contiguous");
  TORCH_CHECK(query.scalar_type() == cache.scalar_type() && query.scalar_type() == out.scalar_type(),
              "query, cache and out of one dtype");
  TORCH_CHECK(qsl.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              table.scalar_type() == at::kInt && reqs.scalar_type() == at::kInt, "int32 index tensors");
  TORCH_CHECK(qsl.is_contiguous() && seq_lens.is_contiguous() && reqs.is_contiguous(), "contiguous index tensors");
}

// query [T, H, D] and out [T, H, D] (rows and heads strided, head_dim contiguous); cache [num_blocks, Hkv,
// 2 * block_size * D]; qsl [R + 1], seq_lens [R], table [R, max_blocks], reqs [M]: the requests (of the R) to
// compute, their rows read from query and written to out in place (int32). Row i of a request of n rows (seq_len s)
// attends to keys < s - n + i + 1.
void multirow_attention(torch::Tensor query, torch::Tensor cache, torch::Tensor qsl, torch::Tensor seq_lens,
                        torch::Tensor table, torch::Tensor reqs, double scale, torch::Tensor out) {
  check_inputs(query, cache, qsl, seq_lens, table, reqs, out, 16);
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kFloat, "float32 or bfloat16");
  const int64_t H = query.size(1), D = query.size(2), Hkv = cache.size(1), M = reqs.size(0);
  const int64_t bs = cache.size(2) / (2 * D);
  auto go = [&](auto tag, auto dim) {
    using T = decltype(tag); constexpr int DD = decltype(dim)::value;
    run<T, DD>((const T*)query.data_ptr(), query.stride(0), query.stride(1), (const T*)cache.data_ptr(),
               qsl.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), table.data_ptr<int32_t>(), table.size(1),
               reqs.data_ptr<int32_t>(), M, H, Hkv, bs, (float)scale, (T*)out.data_ptr(), out.stride(0),
               out.stride(1));
  };
  const bool bf = query.scalar_type() == at::kBFloat16;
  if (D == 64) {
    if (bf) go(uint16_t{}, std::integral_constant<int, 64>{}); else go(float{}, std::integral_constant<int, 64>{});
  } else {
    if (bf) go(uint16_t{}, std::integral_constant<int, 128>{}); else go(float{}, std::integral_constant<int, 128>{});
  }
}

#if defined(ENTMTP_AVX512)
// The same attention on vLLM's ``amx`` layout (bfloat16 only, on CPUs with AMX), with AMX tiles. Per block and KV
// head the layout holds K in groups of 16 tokens, each ``[head_dim / 2][16 tokens][2]`` (pairs of head elements:
// an AMX B tile per 32 head elements), then V in groups of 16 head elements, each ``[block_size / 2][16
// elements][2]`` (pairs of tokens: a B tile per 32 tokens). Per request and KV head, up to 16 query vectors (query
// rows x query heads of the KV head) make one A tile: QK is a tile product per 16 tokens and 32 head elements (the
// query unscaled, the scale on the logits, as vLLM's kernel), the online softmax runs in AVX-512 on the logits and
// rounds the probabilities to bfloat16 (as vLLM's), PV a tile product per 16 head elements and 32 tokens into
// float32 accumulators. The unit does the same work for 1 and 16 vectors, so extra rows cost little: on a 2-core
// Xeon with AMX (32 requests, 1,000 tokens of context, 30 layers, one thread) 63.3 / 69.4 / 74.6 / 78.2 ms for 1-4
// rows a request against vLLM's 67.1 / 148.7 / 153.2 / 158.5 (benchmarks/attention_rows.py --kernels vllm,entmtp;
// benchmarks/results/amx-kernel-2026-12-06/).
#define AMX_TILES_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,amx-tile,amx-bf16")))
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

template <int D>
AMX_TILES_TARGET static void tiles_item(const uint16_t* q, int64_t qs0, int64_t qs1, const uint16_t* c,
                                        const int32_t* qsl, const int32_t* sl, const int32_t* tb, int64_t tbw,
                                        int64_t b, int64_t g, int64_t rep, int64_t Hkv, int64_t bs, float scale,
                                        uint16_t* o, int64_t os0, int64_t os1, std::vector<float>& buf,
                                        std::vector<uint16_t>& qbuf, std::vector<uint16_t>& pbuf, int& configured) {
  const int64_t q0 = qsl[b], n = qsl[b + 1] - q0, seq = sl[b], ctx = seq - n, nq_all = n * rep;
  if (n <= 0) return;
  qbuf.resize(nq_all * D);
  for (int64_t i = 0; i < n; ++i) for (int64_t r = 0; r < rep; ++r)
    std::memcpy(qbuf.data() + (i * rep + r) * D, q + (q0 + i) * qs0 + (g * rep + r) * qs1, D * sizeof(uint16_t));
  const int64_t nblk = (seq + bs - 1) / bs;
  for (int64_t v0 = 0; v0 < nq_all; v0 += 16) {
    const int64_t nq = std::min<int64_t>(16, nq_all - v0);
    if (configured != nq) {
      TileConfig cfg;
      for (int t = 0; t < 6; ++t) cfg.colsb[t] = 64;
      cfg.rows[0] = nq; cfg.rows[1] = 16; cfg.rows[2] = nq; cfg.rows[3] = nq; cfg.rows[4] = 16; cfg.rows[5] = nq;
      _tile_loadconfig(&cfg);
      configured = (int)nq;
    }
    buf.assign(nq * D + nq * 2 + nq * bs, 0.f);
    pbuf.assign(nq * bs, 0);
    float* acc = buf.data(); float* m = acc + nq * D; float* l = m + nq; float* s = l + nq;
    const uint16_t* qg = qbuf.data() + v0 * D;
    for (int64_t v = 0; v < nq; ++v) m[v] = -INFINITY;
    for (int64_t j = 0; j < nblk; ++j) {
      const uint16_t* blk = c + ((int64_t)tb[b * tbw + j] * Hkv + g) * 2 * bs * D;
      const int64_t t0 = j * bs, nt = std::min(bs, seq - t0);
      const int64_t nt16 = (nt + 15) / 16 * 16, nt32 = (nt + 31) / 32 * 32;
      for (int64_t tc = 0; tc < nt16; tc += 16) {
        _tile_zero(2);
        for (int k = 0; k < D / 32; ++k) {
          _tile_loadd(0, qg + k * 32, D * 2);
          _tile_loadd(1, blk + tc * D + k * 512, 64);
          _tile_dpbf16ps(2, 0, 1);
        }
        _tile_stored(2, s + tc, bs * 4);
      }
      for (int64_t v = 0; v < nq; ++v) {
        const int64_t lv = std::max<int64_t>(0, std::min(nt, ctx + (v0 + v) / rep + 1 - t0));
        float* sv = s + v * bs;
        uint16_t* pv = pbuf.data() + v * bs;
        if (lv == 0) { std::fill(pv, pv + nt32, (uint16_t)0); continue; }
        __m512 mxv = _mm512_set1_ps(-INFINITY);
        int64_t t = 0;
        for (; t + 16 <= lv; t += 16) mxv = _mm512_max_ps(mxv, _mm512_loadu_ps(sv + t));
        float mx = _mm512_reduce_max_ps(mxv);
        for (; t < lv; ++t) mx = std::max(mx, sv[t]);
        mx = std::max(m[v], mx * scale);
        const __m512 mz = _mm512_set1_ps(mx), sc = _mm512_set1_ps(scale);
        __m512 sumv = _mm512_setzero_ps();
        for (t = 0; t < nt32; t += 16) {
          const __mmask16 k = lv - t >= 16 ? (__mmask16)0xffff
                              : lv <= t ? (__mmask16)0 : (__mmask16)((1u << (lv - t)) - 1);
          const __m512 e = _mm512_maskz_mov_ps(k, vexp(_mm512_fmsub_ps(_mm512_loadu_ps(sv + t), sc, mz)));
          _mm256_storeu_si256((__m256i*)(pv + t), (__m256i)_mm512_cvtneps_pbh(e));
          sumv = _mm512_add_ps(sumv, e);
        }
        const float corr = m[v] == -INFINITY ? 0.f : std::exp(m[v] - mx);
        l[v] = l[v] * corr + _mm512_reduce_add_ps(sumv);
        m[v] = mx;
        if (corr != 1.f) {
          float* av = acc + v * D;
          for (int d = 0; d < D; ++d) av[d] *= corr;
        }
      }
      const uint16_t* V = blk + D * bs;
      for (int i = 0; i < D / 16; ++i) {
        _tile_loadd(5, acc + 16 * i, D * 4);
        for (int64_t tc = 0; tc < nt32; tc += 32) {
          _tile_loadd(3, pbuf.data() + tc, bs * 2);
          _tile_loadd(4, V + i * bs * 16 + tc * 16, 64);
          _tile_dpbf16ps(5, 3, 4);
        }
        _tile_stored(5, acc + 16 * i, D * 4);
      }
    }
    for (int64_t v = 0; v < nq; ++v) {
      const int64_t vv = v0 + v, i = vv / rep, r = vv % rep;
      const float inv = 1.f / l[v];
      uint16_t* dst = o + (q0 + i) * os0 + (g * rep + r) * os1;
      for (int d = 0; d < D; ++d) dst[d] = to_bf16(acc[v * D + d] * inv);
    }
  }
}

AMX_TILES_TARGET static void tiles_release() { _tile_release(); }

template <int D>
static void run_tiles(const uint16_t* q, int64_t qs0, int64_t qs1, const uint16_t* c, const int32_t* qsl,
                      const int32_t* sl, const int32_t* tb, int64_t tbw, const int32_t* reqs, int64_t R, int64_t H,
                      int64_t Hkv, int64_t bs, float scale, uint16_t* o, int64_t os0, int64_t os1) {
  const int64_t rep = H / Hkv;
  at::parallel_for(0, R * Hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    std::vector<uint16_t> qbuf, pbuf;
    int configured = -1;
    for (int64_t w = lo; w < hi; ++w)
      tiles_item<D>(q, qs0, qs1, c, qsl, sl, tb, tbw, reqs[w / Hkv], w % Hkv, rep, Hkv, bs, scale, o, os0, os1, buf,
                    qbuf, pbuf, configured);
    if (configured >= 0) tiles_release();
  });
}

// As multirow_attention, on the ``amx`` layout: bfloat16, block size a multiple of 32, head_dim 64 or 128; the
// process must hold Linux's permission for the AMX tile state (torch.cpu._init_amx(); vLLM's worker asks for it).
void multirow_attention_amx(torch::Tensor query, torch::Tensor cache, torch::Tensor qsl, torch::Tensor seq_lens,
                            torch::Tensor table, torch::Tensor reqs, double scale, torch::Tensor out) {
  check_inputs(query, cache, qsl, seq_lens, table, reqs, out, 32);
  TORCH_CHECK(query.scalar_type() == at::kBFloat16, "bfloat16 (the amx layout holds bfloat16 only)");
  const int64_t H = query.size(1), D = query.size(2), Hkv = cache.size(1), M = reqs.size(0);
  const int64_t bs = cache.size(2) / (2 * D);
  auto go = [&](auto dim) {
    constexpr int DD = decltype(dim)::value;
    run_tiles<DD>((const uint16_t*)query.data_ptr(), query.stride(0), query.stride(1),
                  (const uint16_t*)cache.data_ptr(), qsl.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                  table.data_ptr<int32_t>(), table.size(1), reqs.data_ptr<int32_t>(), M, H, Hkv, bs, (float)scale,
                  (uint16_t*)out.data_ptr(), out.stride(0), out.stride(1));
  };
  if (D == 64) go(std::integral_constant<int, 64>{}); else go(std::integral_constant<int, 128>{});
}

#endif  // ENTMTP_AVX512

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("multirow_attention", &multirow_attention);
#if defined(ENTMTP_AVX512)
  m.def("multirow_attention_amx", &multirow_attention_amx);
#endif
}
