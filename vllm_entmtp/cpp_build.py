"""Building the plugin's C++ CPU kernels (``vllm_entmtp/kernels/*.cpp``) with torch's extension builder.

Each kernel is built the first time an engine needs it (g++ and ninja, some 30 s), then loaded from torch's
extension folder. Where it cannot be built, its caller keeps torch's or vLLM's path and says why.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger("vllm.entmtp")

KERNELS = Path(__file__).parent / "kernels"
#: A build lock older than this is taken as left by a start that was killed while building (torch's lock has no
#: timeout: a later start would wait for it for ever).
STALE_LOCK_S = 600


def isa() -> str | None:
    """The vector ISA the kernels are built for on this CPU: ``"avx512"`` (AVX-512F), ``"avx2"`` (AVX2 and FMA,
    without AVX-512F), or None (neither: the kernels do not apply)."""
    if torch.cpu._is_avx512_supported():
        return "avx512"
    if torch.cpu._is_avx2_supported() and _has_fma():
        return "avx2"
    return None


def _has_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "fma" in line.split()
    except OSError:
        pass
    return False


#: Why the kernels do not apply on a CPU where :func:`isa` is None.
NO_ISA = "this CPU has neither AVX-512F nor AVX2 with FMA"
#: The compiler's flags for each ISA of :func:`isa` (``kernels/simd.h`` picks its vectors by them).
ISA_FLAGS = {"avx512": ["-mavx512f", "-mfma"], "avx2": ["-mavx2", "-mfma"]}


def toolchain_missing() -> str | None:
    """Why the kernels cannot be built and run here (None: they can): a CPU with neither AVX-512F nor AVX2 with FMA,
    no C++ compiler, no ninja."""
    if isa() is None:
        return NO_ISA
    compiler = os.environ.get("CXX", "c++")  # what torch's extension builder runs
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}, from $CXX or c++) to build it"
    from torch.utils.cpp_extension import is_ninja_available
    if not is_ninja_available():
        return "no ninja on PATH to build it (torch's extension builder needs it)"
    return None


def build(name: str, source: str, isa_name: str | None = None):
    """The extension module built from ``kernels/<source>`` for ``isa_name`` (one of :data:`ISA_FLAGS`; None: this
    CPU's :func:`isa`), named ``name``, with ``_avx2`` added for AVX2 (OpenMP: ATen's ``parallel_for`` is OpenMP in
    its headers). An AVX2 build runs on CPUs with AVX-512 too (the tests check it there).

    Raises:
        Exception: whatever the build raises (callers fall back and log it).
    """
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as load_extension
    here = isa_name or isa()
    if here not in ISA_FLAGS:
        raise RuntimeError(f"no vector ISA to build for: {here or NO_ISA}")
    name = name if here == "avx512" else f"{name}_{here}"
    clear_stale_lock(Path(_get_build_directory(name, verbose=False)))
    return load_extension(name, [str(KERNELS / source)], extra_cflags=["-O3", *ISA_FLAGS[here], "-fopenmp"],
                          extra_ldflags=["-fopenmp"], verbose=False)


def clear_stale_lock(build_dir: Path) -> None:
    """Remove a build lock older than :data:`STALE_LOCK_S` (left by a start killed while building)."""
    lock = build_dir / "lock"
    try:
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            logger.warning("entmtp: removed a stale build lock of a kernel: %s", lock)
    except OSError:
        pass


class BuiltKernel:
    """A kernel built once per process and checked once per dtype.

    Args:
        name: the extension module's name.
        source: its file in ``kernels/``.
        unavailable: ``dtype -> why it cannot serve here`` (None: it can be built and tried).
        self_check: ``dtype -> what differed`` from a reference on random inputs (None: it agrees); called after
            the build, with :attr:`module` set.
        fallback: what serves instead, for the log line (``"vLLM's kernel"``).
    """

    def __init__(self, name: str, source: str, unavailable: Callable[[torch.dtype], str | None],
                 self_check: Callable[[torch.dtype], str | None], fallback: str):
        self.name, self.source, self.fallback = name, source, fallback
        self.unavailable, self.self_check = unavailable, self_check
        self.module = None
        self.reason = "not loaded"
        self.checked: set[torch.dtype] = set()

    def load(self, dtype: torch.dtype) -> bool:
        """Build (the first time, some 30 s) and check the kernel in ``dtype`` (once per dtype); True when it is
        ready. A failure logs why and leaves :attr:`reason` saying why, and :attr:`module` None unless another
        dtype passed (``load(dtype)`` is then False for this one)."""
        if self.module is not None and dtype in self.checked:
            return True
        reason = self.unavailable(dtype)
        if reason is None:
            try:
                if self.module is None:
                    self.module = build(self.name, self.source)
                reason = self.self_check(dtype)
                if reason is None:
                    self.checked.add(dtype)
                elif not self.checked:  # a dtype that passed keeps the module (a drafter may hold it)
                    self.module = None
            except Exception as e:  # noqa: BLE001 - the fallback serves instead
                if not self.checked:
                    self.module = None
                reason = f"the kernel did not build: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self.reason = reason or ""
        if reason:
            logger.info("entmtp: %s only: %s", self.fallback, reason)
        return reason is None
