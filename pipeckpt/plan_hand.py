"""A layout given by hand (``strategy.layout=manual``) on a named cluster: checked and predicted as the
search predicts each of its layouts, for the plan command (``python -m pipeckpt.plan ... cluster=NAME``).

Why apart from :mod:`pipeckpt.plan_layout`: that module searches; this one reads the user's own
degrees, schedule, chunks and modes back into the search's terms and asks it for that one row.
"""

from omegaconf import DictConfig, open_dict

from pipeckpt._errors import config_error
from pipeckpt.layout.candidates import Candidate
from pipeckpt.plan_layout import Answer, check_searchable, configured_cluster, search_config
from pipeckpt.plan_settings import strategy_settings

__all__ = ["hand_layout", "check_layout"]


def hand_layout(cfg: DictConfig, world: int) -> Candidate:
    """The layout ``cfg``'s strategy gives by hand (``strategy.layout=manual``) on ``world``
    devices, as the search names layouts: its degrees, schedule, chunks, balance, sequence
    parallelism, FSDP policies and modes (none under ``ckpt=auto``: the search's fit chooses them)."""
    s = cfg.strategy
    v = int(s.get("virtual_stages") or 1)
    if s.get("stages") is None:
        raise config_error(
            "strategy.stages=null with a cluster named",
            "a layout given by hand is checked with its stage count",
            "set strategy.stages, or strategy.layout=auto to search for one",
        )
    pp, tp = int(s.stages) // v, int(s.get("tensor_parallel") or 1)
    sequence = bool(s.get("sequence_parallel")) and tp > 1
    dp = int(s.get("dp") or max(1, world // (pp * tp)))
    if pp * tp * dp != world:
        raise config_error(
            f"pp{pp} x tp{tp} x dp{dp} ({pp * tp * dp} devices) on a cluster of {world}",
            "a layout checked on a cluster uses every one of its devices",
            "set trainer.devices and trainer.num_nodes (or cluster.nodes) to the layout's, or the degrees",
        )
    shard = int(s.get("dp_shard") or dp) if s.get("data_parallel") == "fsdp" else 1
    modes = s.checkpoint
    given = () if modes == "auto" else (str(modes),) if isinstance(modes, str) else tuple(map(str, modes))
    return Candidate(
        pp,
        tp,
        dp // shard,
        shard,
        str(s.get("schedule") or "gpipe"),
        v,
        int(s.chunks),
        given,
        reshard=bool(s.get("reshard_after_forward")),
        reduce_every=bool(s.get("reduce_every_microbatch")),
        sequence=sequence,
        balance=tuple(int(n) for n in s.balance) if s.get("balance") else (),
    )


def check_layout(cfg: DictConfig) -> Answer:
    """The layout given by hand, fitted and predicted on the configured cluster as the search does
    each of its layouts (its own modes kept): its row, or why it does not fit."""
    check_searchable(cfg, "cluster=", ", or drop cluster=")
    where = configured_cluster(cfg)
    strategy_settings(cfg, fit_to=where.device.memory_bytes)  # train.py's checks, in the user's names
    c = hand_layout(cfg, where.world)
    whole = cfg.copy()
    with open_dict(whole):  # the search's batch is the global one; a hand layout's is a replica's
        whole.data.batch_size = int(cfg.data.batch_size) * c.dp
    return search_config(whole, only=[c])
