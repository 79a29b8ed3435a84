"""Experiment (session 37), not part of the plugin: a naive C++ attention kernel that reads each request's paged K/V
(vLLM's CPU ``vec`` layout: per block and KV head, K transposed ``[head_dim, block]`` then V ``[block, head_dim]``)
once for all of the request's query rows, against vLLM's ``cpu_attention_with_kv_cache`` on the same rows.

    python multirow_prototype.py            # compiles with g++ via torch.utils.cpp_extension (about 30 s)
    FAST_MATH=1 python multirow_prototype.py

It first checks its output against vLLM's kernel on K/V written by vLLM's ``cpu_attn_reshape_and_cache``, then times
both over 30 per-layer caches. Results in this folder's README ("A kernel that reads the context once").
"""
import os
import statistics
import time

import torch
from torch.utils.cpp_extension import load_inline
src = r'''
#include <torch/extension.h>
#include <omp.h>
#include <cmath>
#include <cstdint>
#include <vector>
static inline float bf(uint16_t x){ uint32_t u = ((uint32_t)x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
// query [R*rows, H, D] bf16; cache [NB, Hkv, 2*bs*D] bf16 (K^T [D,bs] then V [bs,D]); table [R, maxblk] int32
void multirow_attn(torch::Tensor query, torch::Tensor cache, torch::Tensor table, int64_t ctx, int64_t rows,
                   double scale, torch::Tensor out) {
  const int64_t R = table.size(0), H = query.size(1), D = query.size(2), Hkv = cache.size(1);
  const int64_t bs = cache.size(2) / (2 * D), rep = H / Hkv, nq = rows * rep, seq = ctx + rows;
  const int64_t nblk = (seq + bs - 1) / bs;
  const uint16_t* q = (const uint16_t*)query.data_ptr(); const uint16_t* c = (const uint16_t*)cache.data_ptr();
  const int32_t* tb = table.data_ptr<int32_t>(); uint16_t* o = (uint16_t*)out.data_ptr();
  #pragma omp parallel for schedule(static)
  for (int64_t w = 0; w < R * Hkv; ++w) {
    const int64_t b = w / Hkv, g = w % Hkv;
    std::vector<float> qf(nq * D), acc(nq * D, 0.f), m(nq, -INFINITY), l(nq, 0.f), kb(D * bs), vb(bs * D), s(nq * bs);
    for (int64_t i = 0; i < rows; ++i) for (int64_t r = 0; r < rep; ++r) for (int64_t d = 0; d < D; ++d)
      qf[(i * rep + r) * D + d] = bf(q[((b * rows + i) * H + g * rep + r) * D + d]) * (float)scale;
    for (int64_t j = 0; j < nblk; ++j) {
      const uint16_t* blk = c + ((int64_t)tb[b * table.size(1) + j] * Hkv + g) * 2 * bs * D;
      const int64_t t0 = j * bs, nt = std::min(bs, seq - t0);
      for (int64_t e = 0; e < D * bs; ++e) kb[e] = bf(blk[e]);
      for (int64_t e = 0; e < bs * D; ++e) vb[e] = bf(blk[D * bs + e]);
      for (int64_t v = 0; v < nq; ++v) {
        float* sv = &s[v * bs];
        for (int64_t t = 0; t < bs; ++t) sv[t] = 0.f;
        for (int64_t d = 0; d < D; ++d) { const float qd = qf[v * D + d]; const float* kd = &kb[d * bs];
          for (int64_t t = 0; t < bs; ++t) sv[t] += qd * kd[t]; }
        const int64_t lim = std::min(nt, ctx + v / rep + 1 - t0);  // causal: row i sees < ctx + i + 1
        float mx = m[v];
        for (int64_t t = 0; t < lim; ++t) mx = std::max(mx, sv[t]);
        const float corr = std::exp(m[v] - mx); float sum = 0.f;
        for (int64_t t = 0; t < lim; ++t) { sv[t] = std::exp(sv[t] - mx); sum += sv[t]; }
        for (int64_t t = lim; t < bs; ++t) sv[t] = 0.f;
        l[v] = l[v] * corr + sum; m[v] = mx;
        float* av = &acc[v * D];
        for (int64_t d = 0; d < D; ++d) av[d] *= corr;
        for (int64_t t = 0; t < lim; ++t) { const float p = sv[t]; const float* vt = &vb[t * D];
          for (int64_t d = 0; d < D; ++d) av[d] += p * vt[d]; }
      }
    }
    for (int64_t i = 0; i < rows; ++i) for (int64_t r = 0; r < rep; ++r) for (int64_t d = 0; d < D; ++d) {
      const int64_t v = i * rep + r; float x = acc[v * D + d] / l[v]; uint32_t u; std::memcpy(&u, &x, 4);
      o[((b * rows + i) * H + g * rep + r) * D + d] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); }
  }
}
'''
FLAGS = ["-O3", "-march=native", "-fopenmp"] + (["-ffast-math"] if os.environ.get("FAST_MATH") else [])
mod = load_inline("proto_attn" + ("_fm" if os.environ.get("FAST_MATH") else ""), cpp_sources=src,
                  functions=["multirow_attn"], extra_cflags=FLAGS,
                  extra_ldflags=["-fopenmp"], verbose=False)
import vllm._custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
H, HKV, D, BS, L = 9, 3, 64, 128, 30
dt = torch.bfloat16
isa = _get_attn_isa(dt, BS, D, "auto")
def vllm_fn(R, ctx, rows, caches, table):
    qsl = torch.arange(0, R * rows + 1, rows, dtype=torch.int32)
    sl = torch.full((R,), ctx + rows, dtype=torch.int32)
    q = torch.randn(R * rows, H, D, dtype=dt); out = torch.empty_like(q)
    def f():
        md = ops.cpu_attn_get_scheduler_metadata(num_reqs=R, num_heads=H, num_kv_heads=HKV, head_dim=D, seq_lens=sl,
            dtype=dt, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
        for cch in caches:
            kc, vc = cch.view(cch.shape[0], HKV, 2 * BS, D).chunk(2, dim=2)
            ops.cpu_attention_with_kv_cache(query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
                seq_lens=sl, scale=0.125, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
                softcap=0.0, scheduler_metadata=md, s_aux=None)
        return out
    return f, q
def proto_fn(R, ctx, rows, caches, table, q=None):
    q = torch.randn(R * rows, H, D, dtype=dt) if q is None else q
    out = torch.empty_like(q)
    def f():
        for cch in caches:
            mod.multirow_attn(q, cch.view(cch.shape[0], HKV, -1), table, ctx, rows, 0.125, out)
        return out
    return f
# correctness: write K/V with vLLM's reshape_and_cache, compare one layer
R, ctx, rows = 3, 300, 2
per = -(-(ctx + rows) // BS)
cache = torch.zeros(R * per, HKV, BS, 2 * D, dtype=dt)
table = torch.arange(R * per, dtype=torch.int32).view(R, per)
k = torch.randn(R * (ctx + rows), HKV, D, dtype=dt); v = torch.randn(R * (ctx + rows), HKV, D, dtype=dt)
slots = torch.cat([torch.arange(b * per * BS, b * per * BS + ctx + rows) for b in range(R)])
kc, vc = cache.view(R * per, HKV, 2 * BS, D).chunk(2, dim=2)
ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
fv, q = vllm_fn(R, ctx, rows, [cache], table)
a = fv().float().clone(); bq = proto_fn(R, ctx, rows, [cache], table, q)().float()
print("max abs diff vs vLLM kernel:", (a - bq).abs().max().item(), "max |out|", a.abs().max().item())
def t(f, reps=9):
    f(); ts = []
    for _ in range(reps):
        x = time.perf_counter(); f(); ts.append(time.perf_counter() - x)
    return 1000 * statistics.median(ts)
for R, ctx in ((16, 300), (16, 1000), (32, 1000), (1, 1000)):
    per = -(-(ctx + 4) // BS)
    caches = [torch.randn(R * per, HKV, BS, 2 * D, dtype=dt) for _ in range(L)]
    table = torch.arange(R * per, dtype=torch.int32).view(R, per)
    res = {}
    for rows in (1, 2, 4):
        res[f"vllm{rows}"] = t(vllm_fn(R, ctx, rows, caches, table)[0])
        res[f"proto{rows}"] = t(proto_fn(R, ctx, rows, caches, table))
    print(R, ctx, {k_: round(v_, 2) for k_, v_ in res.items()}, flush=True)
