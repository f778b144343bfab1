"""Meshes and process groups made once per default process group, and handed to every later fit.

Why: torch opens a mesh's process groups (``init_device_mesh``, a dimension split for HSDP) and
``dist.new_group``'s each time it is asked, and frees them only when the default group is
destroyed. On gloo each group holds a connection loop and two worker threads. A process that fits
one Trainer after another (a sweep, a notebook, ``fit`` then another ``fit``) on ``dp > 1``, tensor
parallelism or FSDP gathered a set of them per fit, never closed.

Why not destroy them at teardown instead: after ``fit`` the module's FSDP or tensor-parallel
parameters are still DTensors on the mesh, and what a user does next with them
(``trainer.save_checkpoint``, ``trainer.test``) talks over its groups. So each is made once, on
every rank at the same point (every rank fits the same layouts in the same order, so every rank
finds or misses the same key), and kept for as long as the default group lives. A new default group
(after ``dist.destroy_process_group()`` and a new init) starts afresh.

They are let go at exit (``atexit``), while the interpreter still runs: a group this module still
held after ``dist.destroy_process_group()`` would otherwise outlive the interpreter's finalisation,
which need not free it, and reach the C++ runtime's exit with gloo's threads still running (a CI
run's benchmark rank aborted there once: "terminate called without an active exception").
"""

import atexit
from typing import Any, Callable, Dict, Hashable, List, Optional, TypeVar

import torch.distributed as dist

__all__: List[str] = []

T = TypeVar("T")

_kept: Dict[Hashable, Any] = {}
_world: Optional[dist.ProcessGroup] = None  # the default group they were made under (held: its
# identity cannot pass to a later one while it is)


def kept(key: Hashable, make: Callable[[], T]) -> T:
    """What ``make()`` made for ``key`` under the current default group, made now if nothing was.
    A collective when it makes (``make`` is one): every rank calls it with the same keys."""
    global _world
    world = dist.group.WORLD
    if world is not _world:  # a new default group: the groups kept under the old one are gone
        _kept.clear()
        _world = world
    if key not in _kept:
        _kept[key] = make()
    return _kept[key]


@atexit.register
def _let_go() -> None:
    """Drops every group and mesh kept, and the default group's reference, so that each is freed
    (its threads joined) now, or by torch's own references' end, never after the interpreter's."""
    global _world
    _kept.clear()
    _world = None
