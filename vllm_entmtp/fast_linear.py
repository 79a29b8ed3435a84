"""The heads' small linear layers, each by the kernel that is fastest on the machine at hand, measured at start-up.

A draft step multiplies one to a few rows by each head's weights and by the draft lm_head: memory-bound GEMVs
whose cost depends on the kernel and the dtype far more than on the arithmetic. Measured on two 2-core Xeons
(2026-12-01, ``benchmarks/step_profile.py``): torch's ``F.linear`` on a bfloat16 8,192 x 576 weight took 490 us
for one row, vLLM's oneDNN kernel (what vLLM's CPU backend runs the target's layers with) 240 us; in float32
torch's was the faster below 4 rows and oneDNN's from 5 rows on; on an AVX2-only machine a float16 copy of a
float32 weight halved torch's time. No fixed rule holds on every CPU, so :class:`FastLinear` times its candidate
kernels once, at one row and at :data:`LARGE_ROWS` rows, and keeps the faster of each.

All candidates compute ``x @ W.T + b`` on the same weights; they differ in rounding (float16 candidates by up to
1e-3 relative), which can change a draft token at a near-tie and never the output (verification decides).

Not a candidate: int8 weights (per output row, torch's ``aten._weight_int8pack_mm``). Tried 2026-12-04 on the
2-core EPYC (bfloat16, in one engine, a chain of 2 for every request, GSM8K): with the weights cold, as after the
target's forward, it cut the heads' time per step from 1.06-1.11 to 0.90-0.96 ms, but its rounding changed the
first draft token in 4-10 % of the steps against the bfloat16 heads (the head blocks read the target's hidden
state, whose few large channels dominate a row's 8-bit error), and the same prompts took 825 steps against 786.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger("vllm.entmtp")

Kernel = Callable[[torch.Tensor], torch.Tensor]

#: Evaluations of more rows than :data:`SMALL_ROWS` use the kernel that was fastest at this many rows.
LARGE_ROWS = 8
SMALL_ROWS = 4


def onednn_kernel(weight: torch.Tensor, bias: torch.Tensor | None) -> Kernel | None:
    """``x -> x @ weight.T + bias`` by vLLM's CPU oneDNN GEMM (``onednn_mm``), or None where vLLM, its CPU ops or
    oneDNN are not available, or the weight is not on a CPU."""
    if weight.device.type != "cpu":
        return None
    try:
        from vllm import _custom_ops as ops
    except Exception:  # noqa: BLE001 - no vLLM, or no CPU build of it
        return None
    if not getattr(ops, "_supports_onednn", False):
        return None
    try:
        handle = ops.create_onednn_mm(weight.t(), 32)
    except RuntimeError:  # a dtype or shape oneDNN refuses
        return None
    b = bias.to(weight.dtype) if bias is not None else None

    def f(x: torch.Tensor) -> torch.Tensor:
        y = ops.onednn_mm(handle, x.reshape(-1, x.shape[-1]).contiguous(), b)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    f.handle = handle  # keep the oneDNN primitive alive with the closure
    return f


def candidate_kernels(weight: torch.Tensor, bias: torch.Tensor | None = None) -> dict[str, Kernel]:
    """The kernels :class:`FastLinear` chooses from: ``torch`` (``F.linear``), ``onednn`` (vLLM's, where
    available) and, for a float32 CPU weight, ``float16`` (``F.linear`` on a float16 copy, result in float32)."""
    w, b = weight.detach().contiguous(), (bias.detach().contiguous() if bias is not None else None)
    out: dict[str, Kernel] = {"torch": lambda x: torch.nn.functional.linear(x, w, b)}
    dnn = onednn_kernel(w, b)
    if dnn is not None:
        out["onednn"] = dnn
    if w.dtype == torch.float32 and w.device.type == "cpu":
        wh, bh = w.half(), (b.half() if b is not None else None)
        out["float16"] = lambda x: torch.nn.functional.linear(x.half(), wh, bh).float()
    return out


def time_kernel(kernel: Kernel, x: torch.Tensor, repeats: int = 15) -> float:
    """Median seconds of ``kernel(x)`` after two warm-up calls."""
    kernel(x)
    kernel(x)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        kernel(x)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


class FastLinear:
    """``x @ weight.T + bias`` by the fastest of :func:`candidate_kernels`, timed once at one row and at
    :data:`LARGE_ROWS` rows; calls with at most :data:`SMALL_ROWS` rows use the first winner, larger ones the
    second.

    Args:
        weight: ``[out, in]``.
        bias: ``[out]`` or None.
        kernel: a candidate's name to use it always (no timing), or None (measure).

    Raises:
        ValueError: ``kernel`` is not a candidate here.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, kernel: str | None = None):
        self.kernels = candidate_kernels(weight, bias)
        self.out_features, self.in_features = weight.shape
        if kernel is not None:
            if kernel not in self.kernels:
                raise ValueError(f"kernel {kernel!r} is not available here: {', '.join(self.kernels)}")
            self.small = self.large = kernel
            self.timings: dict[int, dict[str, float]] = {}
            return
        self.timings = {}
        with torch.inference_mode():
            for rows in (1, LARGE_ROWS):
                x = torch.randn(rows, self.in_features, dtype=weight.dtype, device=weight.device)
                self.timings[rows] = {name: time_kernel(k, x) for name, k in self.kernels.items()}
        self.small = min(self.timings[1], key=self.timings[1].get)
        self.large = min(self.timings[LARGE_ROWS], key=self.timings[LARGE_ROWS].get)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels[self.small if x.shape[0] <= SMALL_ROWS else self.large](x)

    def describe(self) -> str:
        """``"small: onednn, large: torch"``."""
        return f"1-{SMALL_ROWS} rows: {self.small}, more: {self.large}"


def use_vllm_cpu_gemm(model: torch.nn.Module) -> bool:
    """Run every float32 ``nn.Linear`` of ``model`` (the lm_head included) through vLLM's CPU GEMM (oneDNN
    ``onednn_mm``, what vLLM's CPU backend uses for these layers), so that verification costs are timed with
    the kernels that serve them: torch's own small-M GEMM costs differ a lot (on an AVX2 CPU, 2 or 3 rows of the
    lm_head take 2-3x one row in torch, ~1.2x in oneDNN). In place; False (nothing changed) when vLLM or its
    oneDNN ops are not available."""
    probe = torch.nn.Linear(2, 2)
    if onednn_kernel(probe.weight.detach(), None) is None:
        return False
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32:
            m.forward = onednn_kernel(m.weight.detach(), m.bias.detach() if m.bias is not None else None)
    return True
