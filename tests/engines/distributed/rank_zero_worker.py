"""One rank of test_startup.py's hand-off tests: ``from_rank_zero`` on a launch by hand (``LOCAL_RANK``
set), rank 0's work given by ``argv[1]``: ``dies`` (the process ends after 2 s, handing nothing on)
or ``answers`` (its text, after 2 s); each rank prints what it got."""

import os
import sys
import time

from pipeckpt.engines.distributed.startup import from_rank_zero, outside_launcher


def work() -> str:
    time.sleep(2)
    if sys.argv[1] == "dies":
        os._exit(3)
    return "rank 0's answer"


if __name__ == "__main__":
    environment = outside_launcher(devices=2, num_nodes=1)
    assert environment is not None
    print("got:", from_rank_zero(environment, "test", work, window_s=600, what="the test's work"), flush=True)
