"""MTP heads: draft-token proposers that read the target model's last hidden state."""
from vllm_entmtp.heads.medusa import MedusaHeads, MedusaHeadsConfig, load_heads

__all__ = ["MedusaHeads", "MedusaHeadsConfig", "load_heads"]
