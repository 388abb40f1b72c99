"""slurm-colloc: safe GPU sharing with NVIDIA MPS on Slurm clusters."""

__version__ = "0.1.0"
