"""Training state on disk: atomic checkpoint files, sharded (DCP) directories, and the
preemption signal answered at a step boundary."""
