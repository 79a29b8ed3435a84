"""Patch of vLLM's V1 model runner for seeded requests on CPUs, every method (plain decoding included).

| symbol | change |
|---|---|
| ``GPUModelRunner._sample``, ``_bookkeeping_sync`` | a seeded request whose sample is discarded (a prefill chunk that does not reach the end of its prompt) made vLLM rewind its generator with ``Generator.set_offset``, which CPU generators lack: the engine died on the first seeded request in a chunk. Its generator state is saved before sampling and restored after it (the same effect), and ``_bookkeeping_sync`` does not see it |
"""
from __future__ import annotations

import numpy as np
import torch


def discarded_cpu_generators(runner) -> dict[int, torch.Generator]:
    """Seeded CPU generators of the requests whose sample this step is discarded (a prefill chunk that does not
    reach the end of the prompt), by batch index."""
    n = runner.input_batch.num_reqs
    gens = runner.input_batch.generators
    if not gens:
        return {}
    return {int(i): gens[int(i)] for i in np.nonzero(runner.discard_request_mask.np[:n])[0]
            if int(i) in gens and gens[int(i)].device.type == "cpu"}


def apply() -> None:
    import vllm.v1.worker.gpu_model_runner as gmr

    R = gmr.GPUModelRunner
    if getattr(R._bookkeeping_sync, "_entmtp_patched", False):
        return
    orig_sample, orig_bookkeeping = R._sample, R._bookkeeping_sync

    def _sample(self, logits, spec_decode_metadata):
        saved = {i: g.get_state() for i, g in discarded_cpu_generators(self).items()}
        out = orig_sample(self, logits, spec_decode_metadata)
        for i, state in saved.items():
            self.input_batch.generators[i].set_state(state)
        return out

    def _bookkeeping_sync(self, *args, **kwargs):
        hidden = discarded_cpu_generators(self)  # already restored in _sample
        for i in hidden:
            del self.input_batch.generators[i]
        try:
            return orig_bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(hidden)

    _bookkeeping_sync._entmtp_patched = True
    R._sample = _sample
    R._bookkeeping_sync = _bookkeeping_sync
