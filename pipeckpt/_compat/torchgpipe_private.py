"""Every reach into torchgpipe's internal modules (its public API is GPipe alone).

Each entry says why no public API serves; ``tests/test_compat.py`` checks each by name and
behaviour.
"""

# torchgpipe exports only GPipe, is_checkpointing and is_recomputing. The engine reuses
# some of its parts (not its GPipe module, which owns and renames the user's layers and
# has one global checkpoint mode), so these are torchgpipe's internal modules.
from torchgpipe import microbatch
from torchgpipe.batchnorm import DeferredBatchNorm

# The thread-local that torchgpipe's is_checkpointing()/is_recomputing() read: a stage flips
# the two flags directly twice per micro-batch, where torchgpipe's own setters
# (enable_checkpointing/enable_recomputing) are generator context managers.
from torchgpipe.checkpoint import thread_local as gpipe_flags

# A zero-size "phony" edge that orders two micro-batches' backward across devices (the
# engine runs forward on one thread, but autograd runs each device's backward on its own).
from torchgpipe.dependency import fork as fork_dependency
from torchgpipe.dependency import join as join_dependency

# Finds @skippable stash/pop routes between stages, which the engine refuses.
from torchgpipe.skip.layout import inspect_skip_layout

__all__ = [
    "DeferredBatchNorm",
    "fork_dependency",
    "gpipe_flags",
    "inspect_skip_layout",
    "join_dependency",
    "microbatch",
]
