"""What the benchmarks share: timing, output, child processes, the disk folder check, and the
data (blocks, requests, a sidecar, a random-weight model) that more than one benchmark uses."""
