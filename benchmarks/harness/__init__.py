"""What the benchmarks share: the machine's description, real rank processes, a per-stage memory
tracker. The tests reuse the tracker; the benchmarks never import the tests."""
