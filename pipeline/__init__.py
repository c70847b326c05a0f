"""InstructGPT-style RLHF as one reproducible pipeline: prepare -> sft -> reward -> ppo -> evaluate."""
