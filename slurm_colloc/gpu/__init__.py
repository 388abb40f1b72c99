"""GPU backends: NVML/DCGM for real nodes, the simulation for tests and the demo."""
