"""Stand-ins shared by the tests, the demo and the benchmarks: the tiny local model,
a fake vLLM (`fake_upstream`) and helpers that start `overnight serve` as a process."""
