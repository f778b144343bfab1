"""Layout search: which pipeline x tensor x data-parallel layout, schedule, chunks and checkpoint modes
to train a model with on a cluster, and the step time it will reach (issue 44).

A package of its own above memory/, engines/ and settings: it reuses their rules (the schedules' op
orders, the sharding of states, the per-layer profile) rather than restating them, and the CLIs (plan,
app) sit above it.
"""
