"""vllm_entmtp/patches/runner.py: a step in which no request has draft tokens is prepared as without speculation
(engines whose output must equal plain decoding's through such steps: tests/test_lossless.py); only an entmtp
runner overrides vLLM's CPU attention (an entmtp engine verifying branching trees through it:
tests/test_lossless.py)."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.utils import CpuGpuBuffer

from vllm_entmtp.patches.runner import prepare_without_drafts

SPEC = object()  # the runner's SpeculativeConfig


def runner(num_computed, num_prompt, slots=6):
    buf = CpuGpuBuffer(slots, dtype=torch.int32, device=torch.device("cpu"), with_numpy=True)
    buf.np.fill(7)  # the previous step's values
    buf.copy_to_gpu()
    batch = SimpleNamespace(num_reqs=len(num_computed), num_computed_tokens_cpu=np.array(num_computed + [0] * 2),
                            num_prompt_tokens=np.array(num_prompt + [0] * 2))
    return SimpleNamespace(speculative_config=SPEC, input_batch=batch, num_decode_draft_tokens=buf)


def test_vllm_prepares_the_step_without_speculation_and_gets_its_config_back():
    r = runner([10, 3], [10, 8])
    seen = []

    def prepare(rr, scheduler_output, num_scheduled_tokens):
        seen.append(rr.speculative_config)
        return "logits indices", None, 1

    assert prepare_without_drafts(r, prepare, None, np.array([1, 5])) == ("logits indices", None, 1)
    assert seen == [None]  # vLLM 0.32's _prepare_inputs takes its plain path on this
    assert r.speculative_config is SPEC


def test_the_config_comes_back_when_vllm_raises():
    r = runner([10], [10])

    def prepare(rr, scheduler_output, num_scheduled_tokens):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        prepare_without_drafts(r, prepare, None, np.array([1]))
    assert r.speculative_config is SPEC


def test_decode_rows_count_zero_draft_tokens_as_vllms_speculative_path_writes_them():
    # request 0 decodes (its prompt computed, one token scheduled), request 1 is a prompt chunk, request 2
    # decodes, request 3 is the last chunk of its prompt (one token scheduled, but the prompt not yet computed)
    r = runner([12, 3, 40, 9], [10, 8, 40, 10])
    prepare_without_drafts(r, lambda *a: None, None, np.array([1, 5, 1, 1]))
    expected = [0, -1, 0, -1, -1, -1]  # then the unused slots
    assert r.num_decode_draft_tokens.np.tolist() == expected
    assert r.num_decode_draft_tokens.gpu.tolist() == expected  # copied to the device, as vLLM's path does


def test_the_plugins_patches_leave_vllms_cpu_attention_to_engines_without_entmtp():
    code = ("from vllm_entmtp.patches import apply_all\n"
            "apply_all()\n"  # what the plugin does in every process vLLM starts
            "from vllm.v1.attention.backends.registry import AttentionBackendEnum\n"
            "print(AttentionBackendEnum.CPU_ATTN.get_path())\n"
            "from vllm_entmtp.patches.runner import use_tree_attention\n"
            "use_tree_attention()\n"  # what an entmtp runner's __init__ does
            "print(AttentionBackendEnum.CPU_ATTN.get_path())\n"
            "use_tree_attention(False)\n"  # a runner without entmtp built next in the same process
            "print(AttentionBackendEnum.CPU_ATTN.get_path())\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    vllms, ours = ("vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend",
                   "vllm_entmtp.patches.tree_attention.TreeCPUAttentionBackend")
    assert p.stdout.split() == [vllms, ours, vllms]
