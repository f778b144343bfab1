"""Which dimension of a parameter torch's tensor-parallel styles split, as the memory model counts a
rank's share (memory/sharding.py for the layers, memory/outside_share.py for an embedding or head
split over the vocabulary). A parameter not named here is replicated over ``tp``."""

from typing import Dict, List, Optional, Tuple, Type

from torch import nn

__all__: List[str] = []

#: The split dimension by style, module type and parameter name.
SPLIT_DIM: Dict[Tuple[str, Type[nn.Module]], Dict[str, int]] = {
    ("colwise", nn.Linear): {"weight": 0, "bias": 0},
    ("rowwise", nn.Linear): {"weight": 1},
    ("colwise", nn.Embedding): {"weight": 1},
    ("rowwise", nn.Embedding): {"weight": 0},
}


def split_dims(module: nn.Module, style: Optional[str]) -> Dict[str, int]:
    """The split dimension of each of ``module``'s own parameters that ``style`` splits."""
    return next((d for (st, t), d in SPLIT_DIM.items() if st == style and isinstance(module, t)), {})
