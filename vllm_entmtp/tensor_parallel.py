"""The heads under tensor parallelism: whole-vocabulary copies of the target's sharded embedding and lm_head.

With ``--tensor-parallel-size N`` vLLM splits the target's input embedding and lm_head by vocabulary
(``VocabParallelEmbedding``): rank ``r`` holds the rows of its vocabulary range only. The heads run whole on every
rank (they are small): Hydra heads read rows of the lm_head for their draft vocabulary and embed the tokens of a
draft path, so each rank gets, once at load, the full rows of both (:func:`full_vocab_weight`: every rank writes
its range into a zero tensor, one all-reduce sums them). Drafting then runs no collective, so ranks never wait on
each other mid-step; every rank drafts the same tokens from the same inputs, as long as its choices are
deterministic (the drafter turns off what is timed per rank: kernel measurement and the measured load rule), and
the ranks compute the same floats (run them with equal thread counts: a confidence at a threshold could pick
different trees otherwise). The copy is the embedding's plain rows: a target whose ``embed_input_ids`` scales
them (not the Llama family) would need that scaling here too.
Medusa heads keep the target's ``compute_logits``, which all-gathers the logits on every rank in step.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def tp_rank_and_size() -> tuple[int, int]:
    """``(rank, world size)`` of this worker's tensor-parallel group; ``(0, 1)`` outside one."""
    try:
        from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size, model_parallel_is_initialized)
    except ImportError:
        return 0, 1
    if not model_parallel_is_initialized():
        return 0, 1
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def full_vocab_weight(layer: torch.nn.Module, vocab_size: int) -> torch.Tensor:
    """``[vocab_size, hidden]``: the rows of a vocabulary-parallel layer (embedding or lm_head) for the whole
    vocabulary, on every rank (one all-reduce).

    Raises:
        RuntimeError: a layer with added (LoRA) vocabulary, whose rows are not the token ids in order.
    """
    from vllm.distributed import tensor_model_parallel_all_reduce

    if getattr(layer, "tp_size", 1) == 1:  # not split (e.g. built with disable_tp): the rows are all here
        return layer.weight[:vocab_size]
    idx = layer.shard_indices
    if idx.num_added_elements:
        raise RuntimeError("entmtp under tensor parallelism: the target's vocabulary-parallel layer has added "
                           "vocabulary; MTP heads need its rows in token-id order")
    w = layer.weight
    full = torch.zeros(vocab_size, w.shape[1], dtype=w.dtype, device=w.device)
    lo, hi = idx.org_vocab_start_index, min(idx.org_vocab_end_index, vocab_size)
    full[lo:hi] = w[:hi - lo]
    return tensor_model_parallel_all_reduce(full)


def input_embedding_layer(target_model: torch.nn.Module) -> torch.nn.Module:
    """The target's input embedding: ``get_input_embeddings()`` where the model has it, else its one
    vocabulary-parallel layer that is not the lm_head."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    get = getattr(target_model, "get_input_embeddings", None)
    layer = get() if callable(get) else None
    if isinstance(layer, VocabParallelEmbedding):
        return layer
    found = [m for m in target_model.modules()
             if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    if len(found) != 1:
        raise RuntimeError(f"entmtp under tensor parallelism: found {len(found)} input embeddings in the target "
                           f"model ({type(target_model).__name__}), expected one")
    return found[0]


def whole_vocab_lm_and_embed(target_model: torch.nn.Module, vocab_size: int
                             ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``(lm_head weight [vocab_size, hidden], embed: token ids -> [N, hidden])`` over the whole vocabulary, built
    once from the target's shards (one copy when the target ties its lm_head to its embedding)."""
    emb_layer = input_embedding_layer(target_model)
    emb = full_vocab_weight(emb_layer, vocab_size)
    lm_layer = getattr(target_model, "lm_head", None)
    tied = lm_layer is None or lm_layer is emb_layer or getattr(lm_layer, "weight", None) is emb_layer.weight
    lm = emb if tied else full_vocab_weight(lm_layer, vocab_size)
    return lm, lambda ids: torch.nn.functional.embedding(ids, emb)
