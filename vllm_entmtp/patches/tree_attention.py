"""Override of vLLM's CPU attention backend (``CPU_ATTN``) that verifies draft trees, and runs the rows of requests
that verify draft tokens through the plugin's kernel (:mod:`vllm_entmtp.verify_attention`, option
``verify_attention``, on the ``vec`` layout with AVX-512F or AVX2 with FMA and on the ``amx`` layout; with them the
step's requests of one row, while longer prompt chunks run vLLM's kernel as a batch of their own, and a step that
verifies no draft token runs vLLM's kernel alone, as plain decoding).

vLLM's CPU kernel (``torch.ops._C.cpu_attention_with_kv_cache``) knows causal masks only. For a request whose
draft tokens form a tree, the kernel first runs as usual; then the rows whose causal view is wrong (they would
see siblings and cousins) are recomputed here with the tree's ancestor-or-self mask: per request and layer, the
request's K/V blocks are read once from the paged cache (one gather, not one per row), and all its tree rows
are computed in two block-batched matmuls in float32 on the cache's own layout. Rows of other requests are
untouched.

KV layout: the ``vec`` ISA of the CPU backend (x86 without AMX, AVX2-only CPUs included, and fp32 everywhere) stores
each block as ``[num_kv_heads, 2, block_size * head_size]`` with K transposed (``[head_size, block_size]``)
and V plain (``[block_size, head_size]``). Other ISAs pack differently (``amx``: bfloat16 on CPUs with AMX); the
runner only drafts trees when every layer runs ``vec`` (chains need no mask and work everywhere: this override
leaves a step whose requests verify chains alone, sampled chains included, whatever the layout).

GPU seam: the same per-request ancestor mask is what a GPU path needs (``vllm_entmtp/tree_mask.py`` builds it for
a packed batch as an additive bias or a FlexAttention ``mask_mod``), e.g. as a per-request ``qq_bias`` in vLLM's
Triton unified attention or a FlexAttention ``mask_mod`` (``docs/architecture.md``).
"""
from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import AttentionType, CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_entmtp import verify_attention
from vllm_entmtp.step import STEP

#: The KV layout the tree-row fix reads (the verification kernel reads more: ``verify_attention.LAYOUTS``).
SUPPORTED_ISA = "vec"


def tree_rows_plan(block_ids: torch.Tensor, seq_len: int, num_rows: int, mask: torch.Tensor, rows: list[int],
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`tree_rows_attention` needs besides the layer's tensors, the same in every layer of a step:
    ``(blocks [nblk] int64, rows [r] int64, additive mask [nblk, 1, 1, r, block_size] float32 (0 or -inf))``."""
    nblk = (seq_len + block_size - 1) // block_size
    sel = torch.tensor(rows, dtype=torch.long)
    ctx = seq_len - num_rows
    allowed = torch.zeros(len(rows), nblk * block_size, dtype=torch.bool)
    allowed[:, :ctx] = True
    allowed[:, ctx:seq_len] = mask[sel]
    bias = torch.zeros(len(rows), nblk * block_size).masked_fill_(~allowed, float("-inf"))
    bias = bias.view(len(rows), nblk, block_size).permute(1, 0, 2).unsqueeze(1).unsqueeze(2).contiguous()
    return block_ids[:nblk].long(), sel, bias


def tree_rows_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int,
                        num_rows: int, mask: torch.Tensor, rows: list[int], scale: float,
                        plan: tuple | None = None) -> torch.Tensor:
    """Attention of tree rows over the context and their ancestors, read from a ``vec``-layout paged cache.

    The request's blocks are gathered once (one copy); scores and outputs are block-batched matmuls on the
    cache's own layout (K stored ``[head_size, block_size]`` per block and head, V ``[block_size, head_size]``),
    so the context is not permuted or copied again; only the small score tensor is.

    Args:
        query: ``[num_rows, H, D]``, the request's query rows (root first).
        kv_cache: ``[num_blocks, Hkv, block_size, 2 * D]`` (one layer), holding the context and these rows.
        block_ids: the request's block table (int), at least ``ceil(seq_len / block_size)`` entries.
        seq_len: context length + ``num_rows`` (the rows' own K/V sit at positions ``seq_len - num_rows ..``).
        mask: ``[num_rows, num_rows]`` bool ancestor-or-self mask.
        rows: which rows to compute.
        plan: :func:`tree_rows_plan` of these arguments (computed here when None; the attention override
            computes it once per step and request, not once per layer).

    Returns:
        ``[len(rows), H, D]`` in the query's dtype.
    """
    nb, hkv, bs, two_d = kv_cache.shape
    d = two_d // 2
    h = query.shape[1]
    rep = h // hkv
    blocks, sel, bias = plan if plan is not None else tree_rows_plan(block_ids, seq_len, num_rows, mask, rows, bs)
    nblk, r = len(blocks), len(sel)
    mem = kv_cache.view(nb, hkv, 2, bs * d)[blocks].float()  # [nblk, Hkv, 2, bs*D]
    k = mem[:, :, 0].view(nblk, hkv, d, bs)  # K^T per block and head
    v = mem[:, :, 1].view(nblk, hkv, bs, d)
    q = query[sel].float().view(r, hkv, rep, d).permute(1, 2, 0, 3).reshape(1, hkv, rep * r, d)
    scores = torch.matmul(q, k)  # [nblk, Hkv, rep*r, bs]
    scores = scores.view(nblk, hkv, rep, r, bs).mul_(scale).add_(bias)
    m = scores.amax(dim=(0, 4), keepdim=True)
    p = (scores - m).exp_()
    denom = p.sum(dim=(0, 4), keepdim=True)  # [1, Hkv, rep, r, 1]
    out = torch.matmul(p.view(nblk, hkv, rep * r, bs), v).sum(0)  # [Hkv, rep*r, D]
    out = out.view(hkv, rep, r, d) / denom[0]
    return out.permute(2, 0, 1, 3).reshape(r, h, d).to(query.dtype)


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """``CPUAttentionBackendImpl`` plus the tree-row fix and a stash of the tree rows' K/V."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if STEP.fixes:  # only a branching tree's accepted path can need its K/V moved (step._compact_kv)
            lo, hi = STEP.row_lo, STEP.row_hi
            STEP.kv[layer.layer_name] = (layer, self, kv_cache, key[lo:hi].clone(), value[lo:hi].clone(),
                                         slot_mapping[lo:hi].clone())

    def _verify_split(self, layer, kv_cache, attn_metadata, query) -> verify_attention.Split | None:
        """The step's split between vLLM's kernel and the verification kernel (:mod:`vllm_entmtp.verify_attention`;
        None: vLLM's for all), planned in the first layer of the step and kept in ``STEP.splits`` for the others."""
        if (attn_metadata is None or not verify_attention.serves(self, layer, kv_cache)
                or getattr(self, "attn_type", None) != AttentionType.DECODER):
            return None
        held = STEP.splits.get(id(attn_metadata))
        if held is not None and held[0] is attn_metadata:
            return held[1]
        split = verify_attention.plan(attn_metadata, self, layer.isa, query.dtype, verifying=STEP.verifying)
        STEP.splits[id(attn_metadata)] = (attn_metadata, split)
        return split

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        split = None
        if output_scale is None and output_block_scale is None:
            split = self._verify_split(layer, kv_cache, attn_metadata, query)
        if split is not None:
            verify_attention.forward(self, layer, query, kv_cache, split, output, attn_metadata.num_actual_tokens)
            out = output
        else:
            out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                  output_block_scale)
        if attn_metadata is None or not STEP.fixes:  # chains (sampled ones too) attend causally: nothing to fix
            return out
        if getattr(layer, "isa", None) != SUPPORTED_ISA:
            raise RuntimeError(f"entmtp tree attention supports the CPU '{SUPPORTED_ISA}' KV layout only; "
                               f"layer {layer.layer_name} uses '{getattr(layer, 'isa', None)}'")
        seq_lens = attn_metadata.seq_lens
        for b, tr in STEP.rows.items():
            if not tr.fix_rows:
                continue
            seq_len = int(seq_lens[b])
            plan = STEP.plans.get(b)
            if plan is None or plan[0] != seq_len:  # once per step and request, shared by the layers
                plan = STEP.plans[b] = (seq_len, tree_rows_plan(attn_metadata.block_table[b], seq_len, tr.num_rows,
                                                                tr.mask, tr.fix_rows, kv_cache.shape[2]))
            q = query[tr.q0:tr.q0 + tr.num_rows].view(tr.num_rows, self.num_heads, self.head_size)
            res = tree_rows_attention(q, kv_cache, attn_metadata.block_table[b], seq_len, tr.num_rows,
                                      tr.mask, tr.fix_rows, self.scale, plan=plan[1])
            o = out[tr.q0:tr.q0 + tr.num_rows].view(tr.num_rows, self.num_heads, self.head_size)
            o[plan[1][1]] = res
        return out


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl

