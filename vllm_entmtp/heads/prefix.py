"""Hydra++'s prefix layer: one extra Llama decoder layer over the target's hidden states of the whole context,
whose output at the last position feeds the Hydra heads instead of the raw hidden state (Ankner et al. 2024,
"Hydra", arXiv 2402.05109, section 4 "Hydra++": "prefix attention"; ``hydra_head_arch: "prefix-mlp"``,
``HydraPrefixMLP.prefix_embeding_layer`` in zankner/Hydra, a one-layer ``LlamaModel`` run on
``inputs_embeds``).

The layer is a standard pre-norm Llama block and a final RMSNorm::

    a = h + o_proj(attention(rope(q_proj(n1(h))), rope(k_proj(n1(h))), v_proj(n1(h))))   # causal, GQA
    p = norm(a + down_proj(silu(gate_proj(n2(a))) * up_proj(n2(a))))

with ``h [T, hidden]`` the target's last hidden states (after its final norm, what the heads otherwise read).
At serving time it runs incrementally: each step feeds the hidden states of the tokens the step committed
(the prompt chunk, or the root and the accepted draft tokens) together with their K/V cache of earlier ones,
kept per request by :class:`vllm_entmtp.proposer.PrefixState`.

Weight names are those of Hugging Face's ``LlamaModel`` with one layer (``layers.0.self_attn.q_proj.weight``,
..., ``norm.weight``; no ``embed_tokens``: the layer reads hidden states, not tokens), so a Hydra++ checkpoint's
``prefix_embeding_layer.*`` weights load as they are.
"""
from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn


class PrefixLayerConfig(BaseModel):
    """Shape of the prefix layer (from the target's config: :meth:`from_target_config`)."""

    model_config = ConfigDict(extra="forbid")

    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)

    @model_validator(mode="after")
    def _check(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embedding)")
        return self

    @classmethod
    def from_target_config(cls, cfg) -> "PrefixLayerConfig":
        """The target's own layer shape (a Hugging Face ``LlamaConfig``-like object or dict), as Hydra++ does
        (``prefix_config = deepcopy(base_config)`` with one layer).

        Raises:
            ValueError: a field the layer needs is missing, or uses RoPE scaling (not supported).
        """
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        heads = get("num_attention_heads")
        if heads is None or get("hidden_size") is None or get("intermediate_size") is None:
            raise ValueError("the target config lacks num_attention_heads, hidden_size or intermediate_size")
        rope = dict(get("rope_scaling") or {}) | dict(get("rope_parameters") or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError("a prefix layer for a target with RoPE scaling is not supported")
        theta = rope.get("rope_theta") or get("rope_theta") or 10000.0
        return cls(num_attention_heads=heads, num_key_value_heads=get("num_key_value_heads") or heads,
                   head_dim=get("head_dim") or get("hidden_size") // heads,
                   intermediate_size=get("intermediate_size"), rms_norm_eps=get("rms_norm_eps", 1e-5) or 1e-5,
                   rope_theta=float(theta))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class _Attention(nn.Module):
    def __init__(self, hidden: int, c: PrefixLayerConfig):
        super().__init__()
        self.q_proj = nn.Linear(hidden, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, hidden: int, c: PrefixLayerConfig):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, hidden: int, c: PrefixLayerConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, c.rms_norm_eps)
        self.self_attn = _Attention(hidden, c)
        self.post_attention_layernorm = RMSNorm(hidden, c.rms_norm_eps)
        self.mlp = _MLP(hidden, c)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PrefixLayer(nn.Module):
    """One Llama decoder layer plus the final norm over the target's hidden states.

    ``forward(h, positions, past=None, valid=None)``:

    * ``h``: ``[B, T, hidden]`` hidden states (float), ``positions``: ``[B, T]`` int64 absolute positions
      (RoPE); row ``t`` attends to the ``past`` K/V and to rows ``<= t``;
    * ``past``: ``(k, v)`` each ``[B, num_key_value_heads, P, head_dim]`` (already rotated), or None;
    * ``valid``: ``[B, P]`` bool, which past slots exist (None: all), for batches of requests with different
      context lengths.

    Returns ``(p [B, T, hidden], (k, v))`` with ``k, v [B, num_key_value_heads, T, head_dim]`` of the new rows
    only (the caller appends them to its cache).
    """

    def __init__(self, hidden_size: int, config: PrefixLayerConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([_Block(hidden_size, config)])
        self.norm = RMSNorm(hidden_size, config.rms_norm_eps)
        blk = self.layers[0]
        for lin in (blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj, blk.mlp.gate_proj,
                    blk.mlp.up_proj):
            nn.init.normal_(lin.weight, std=0.02)
        # the residual branches start at zero: an untrained layer passes h_t through (then the norm)
        nn.init.zeros_(blk.self_attn.o_proj.weight)
        nn.init.zeros_(blk.mlp.down_proj.weight)
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float64)
                                           / config.head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, T, D]
        return (x.float() * emb.cos() + _rotate_half(x.float()) * emb.sin()).to(x.dtype)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None,
                valid: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        c, blk = self.config, self.layers[0]
        B, T, _ = h.shape
        x = blk.input_layernorm(h)
        q = blk.self_attn.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = blk.self_attn.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = blk.self_attn.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = self._rope(q, positions), self._rope(k, positions)
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
        if past is not None and past[0].shape[2] > 0:
            P = past[0].shape[2]
            keys, values = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            seen = valid if valid is not None else torch.ones(B, P, dtype=torch.bool, device=h.device)
            mask = torch.cat([seen[:, None, :].expand(B, T, P), causal.expand(B, T, T)], dim=2)[:, None]
        else:
            keys, values, mask = k, v, causal[None, None]
        rep = c.num_attention_heads // c.num_key_value_heads
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        att = (q @ keys.transpose(-1, -2)) / math.sqrt(c.head_dim)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        o = (att @ values).transpose(1, 2).reshape(B, T, c.num_attention_heads * c.head_dim)
        a = h + blk.self_attn.o_proj(o)
        out = a + blk.mlp(blk.post_attention_layernorm(a))
        return self.norm(out), (k, v)
