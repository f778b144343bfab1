"""engines/distributed/kept_groups: what is kept for later fits is let go before the process ends."""

import subprocess
import sys

# A one-process gloo world whose default group a kept mesh holds, destroyed as a script ends its run.
# atexit runs the last handler registered first: the report is registered before pipeckpt is imported
# (and so before its own handler), so it runs after it. pipeckpt is imported before the group is made:
# some of torch's modules, imported while a group exists, hold it themselves.
KEPT_THEN_EXIT = """
import atexit, gc, os, socket, weakref
world = []
atexit.register(lambda: (gc.collect(), print("held" if world[0]() else "freed", flush=True)))

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from pipeckpt.engines.distributed.kept_groups import kept

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
world.append(weakref.ref(dist.group.WORLD))
kept(("mesh",), lambda: init_device_mesh("cpu", (1,), mesh_dim_names=("pp",)))
dist.destroy_process_group()
gc.collect()
print("held" if world[0]() else "freed", flush=True)
"""


def test_a_destroyed_default_group_that_a_kept_mesh_holds_is_freed_at_exit_not_after():
    done = subprocess.run([sys.executable, "-c", KEPT_THEN_EXIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # held by the kept mesh until the script ends; freed by pipeckpt's exit handler, before finalisation
    assert done.stdout.split() == ["held", "freed"], done.stdout + done.stderr
