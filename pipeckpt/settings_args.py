"""The settings of the ``pipe`` strategy as keyword arguments, for type checkers.

Why a file of its own: :class:`~pipeckpt.settings.PipeSettings` is the source of every setting; this is
the same list typed as ``**kwargs`` (``PipelineStrategy(**settings)``), kept equal to it by
tests/test_settings.py.
"""

from typing import Any, Dict, List, Optional, TypedDict

__all__ = ["PipeSettingsArgs"]


class PipeSettingsArgs(TypedDict, total=False):
    """:class:`PipeSettings`' fields as keyword arguments, for type checkers
    (``PipelineStrategy(**settings)``); tests/test_settings.py keeps the two equal."""

    stages: Optional[int]
    balance: Optional[List[int]]
    balance_by: str
    chunks: int
    checkpoint: Any
    memory_budget: Optional[Any]
    memory_search: Optional[Any]
    memory_optimizer: Optional[str]
    placement: Optional[List[int]]
    deferred_batch_norm: bool
    layer_rng: str
    pin_memory: bool
    compile: Any
    strict: bool
    engine: str
    layout: str
    schedule: Optional[str]
    dp: Optional[int]
    virtual_stages: Optional[int]
    timeout: Optional[float]
    start_timeout: Optional[float]
    data_parallel: Optional[str]
    reshard_after_forward: Optional[bool]
    reduce_every_microbatch: Optional[bool]
    dp_shard: Optional[int]
    tensor_parallel: Optional[int]
    tensor_parallel_plan: Optional[Dict[str, str]]
    sequence_parallel: Optional[bool]
