"""Shared test setup."""

from __future__ import annotations

import os

# No model hub here: everything loads from site-packages or local paths.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per xdist worker (and for the processes it starts): two workers with two threads each on two cores
    # oversubscribe the CPU, and OpenMP's spin-waiting makes model tests several times slower.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
