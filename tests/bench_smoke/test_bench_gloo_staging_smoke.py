"""benchmarks/bench_gloo_staging.py runs end to end on two gloo processes and reports both
collectives; how many copies outlive their call is the machine's, not asserted."""

from support.benchmarks import run_benchmark
from support.ranks import free_port


def test_the_gloo_staging_benchmark_counts_a_copy_in_every_call_of_both_collectives() -> None:
    done = run_benchmark("bench_gloo_staging.py", "--calls", "3", "--port", str(free_port()), timeout=120)
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:5]
        for line in done.stdout.splitlines()
        if "_tensor" in line
    }
    assert set(rows) == {"reduce_scatter_tensor", "all_gather_into_tensor"}
    for calls, made, freed_after in rows.values():
        assert int(made) >= int(calls) == 3  # gloo stages every call's buffer
        assert 0 <= int(freed_after) <= 3
