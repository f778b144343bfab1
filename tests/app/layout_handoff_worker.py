"""One rank of tests/app/test_layout_handoff.py: ``strategy.layout=auto`` applied to this rank's
overrides, as train.py applies it, in a process started by hand (``LOCAL_RANK`` set: Lightning's
launch outside its launcher); the picked settings are written to ``out/rank<r>.json``."""

import json
import os
import sys

from omegaconf import OmegaConf
from support.layout_configs import compose_train

from pipeckpt.plan_pick import apply_layout


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank = int(os.environ["LOCAL_RANK"])
    picked = apply_layout(compose_train(spec["overrides"][rank]))
    out = {"strategy": OmegaConf.to_container(picked.strategy), "batch_size": picked.data.batch_size}
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
