"""The measured fp32 matmul rate that the benchmarks' FLOP floors divide by."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch


def matmul_rates(shapes: Sequence[tuple[int, int, int]], reps: int = 10) -> dict[str, float]:
    """Median fp32 GEMM rate (FLOP/s) of an (m, k) @ (k, n) product, for each (m, k, n)."""
    rates = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n / statistics.median(times)
    return rates
