"""engine-bench: workloads, runners (in-process and remote), statistics and plots."""
