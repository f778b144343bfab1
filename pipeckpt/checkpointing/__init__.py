"""Activation checkpointing: the modes, which micro-batches a schedule keeps, and the ways a
recompute saves memory (selective, release at unpack, host offload, per-layer RNG, regional compile)."""
