"""Override of vLLM's CPU attention backend (``CPU_ATTN``) that verifies draft trees.

vLLM's CPU kernel (``torch.ops._C.cpu_attention_with_kv_cache``) knows causal masks only. For a request whose
draft tokens form a tree, the kernel first runs as usual; then the rows whose causal view is wrong (they would
see siblings and cousins) are recomputed here with the tree's ancestor-or-self mask: per request and layer, the
request's K/V blocks are read once from the paged cache (one gather, not one per row), and all its tree rows
are computed in two batched matmuls in float32. Rows of other requests are untouched.

KV layout: the ``vec`` ISA of the CPU backend (x86 with AVX-512 and without AMX, and fp32 everywhere) stores
each block as ``[num_kv_heads, 2, block_size * head_size]`` with K transposed (``[head_size, block_size]``)
and V plain (``[block_size, head_size]``). Other ISAs pack differently; the runner only drafts trees when every
layer runs ``vec`` (chains need no mask and work everywhere).

GPU seam: the same per-request ancestor mask is what a GPU path needs, as a per-request ``qq_bias`` in vLLM's
Triton unified attention or a FlexAttention ``mask_mod`` (``docs/architecture.md``).
"""
from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_entmtp.patches.tree_step import STEP

SUPPORTED_ISA = "vec"


def tree_rows_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int,
                        num_rows: int, mask: torch.Tensor, rows: list[int], scale: float) -> torch.Tensor:
    """Attention of tree rows over the context and their ancestors, read from a ``vec``-layout paged cache.

    Args:
        query: ``[num_rows, H, D]``, the request's query rows (root first).
        kv_cache: ``[num_blocks, Hkv, block_size, 2 * D]`` (one layer), holding the context and these rows.
        block_ids: the request's block table (int), at least ``ceil(seq_len / block_size)`` entries.
        seq_len: context length + ``num_rows`` (the rows' own K/V sit at positions ``seq_len - num_rows ..``).
        mask: ``[num_rows, num_rows]`` bool ancestor-or-self mask.
        rows: which rows to compute.

    Returns:
        ``[len(rows), H, D]`` in the query's dtype.
    """
    nb, hkv, bs, two_d = kv_cache.shape
    d = two_d // 2
    h = query.shape[1]
    rep = h // hkv
    nblk = (seq_len + bs - 1) // bs
    mem = kv_cache.view(nb, hkv, 2, bs * d)[block_ids[:nblk].long()]  # [nblk, Hkv, 2, bs*D]
    k = mem[:, :, 0].reshape(nblk, hkv, d, bs).permute(1, 2, 0, 3).reshape(hkv, d, nblk * bs).float()
    v = mem[:, :, 1].reshape(nblk, hkv, bs, d).permute(1, 0, 2, 3).reshape(hkv, nblk * bs, d).float()
    sel = torch.tensor(rows, dtype=torch.long)
    r = len(rows)
    q = query[sel].float().view(r, hkv, rep, d).permute(1, 2, 0, 3).reshape(hkv, rep * r, d)
    scores = torch.bmm(q, k) * scale  # [Hkv, rep*r, L]
    ctx = seq_len - num_rows
    allowed = torch.zeros(r, nblk * bs, dtype=torch.bool)
    allowed[:, :ctx] = True
    allowed[:, ctx:seq_len] = mask[sel]
    scores = scores.view(hkv, rep, r, -1).masked_fill(~allowed, float("-inf")).view(hkv, rep * r, -1)
    out = torch.bmm(torch.softmax(scores, dim=-1), v)  # [Hkv, rep*r, D]
    return out.view(hkv, rep, r, d).permute(2, 0, 1, 3).reshape(r, h, d).to(query.dtype)


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """``CPUAttentionBackendImpl`` plus the tree-row fix and a stash of the tree rows' K/V."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if STEP.rows:
            lo, hi = STEP.row_lo, STEP.row_hi
            STEP.kv[layer.layer_name] = (layer, self, kv_cache, key[lo:hi].clone(), value[lo:hi].clone(),
                                         slot_mapping[lo:hi].clone())

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        if attn_metadata is None or not STEP.rows:
            return out
        if getattr(layer, "isa", None) != SUPPORTED_ISA:
            raise RuntimeError(f"entmtp tree attention supports the CPU '{SUPPORTED_ISA}' KV layout only; "
                               f"layer {layer.layer_name} uses '{getattr(layer, 'isa', None)}'")
        seq_lens = attn_metadata.seq_lens
        for b, tr in STEP.rows.items():
            if not tr.fix_rows:
                continue
            q = query[tr.q0:tr.q0 + tr.num_rows].view(tr.num_rows, self.num_heads, self.head_size)
            res = tree_rows_attention(q, kv_cache, attn_metadata.block_table[b], int(seq_lens[b]), tr.num_rows,
                                      tr.mask, tr.fix_rows, self.scale)
            o = out[tr.q0:tr.q0 + tr.num_rows].view(tr.num_rows, self.num_heads, self.head_size)
            o[torch.tensor(tr.fix_rows)] = res
        return out


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl

