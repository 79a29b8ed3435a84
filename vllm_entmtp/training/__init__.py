"""Training of MTP heads by self-distillation from the frozen target model (``vllm-entmtp train-heads``)."""
