"""Measured copy bandwidth of the device the target runs on (the denominator of the byte floors).

GPU: a large device-to-device copy timed with CUDA events; CPU: a large memcpy (torch copy_) timed
with perf_counter. Bandwidth counts read + write bytes (2 * size per copy), median over repeats.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CopyBandwidth:
    bytes_per_s: float  # (read + write bytes) / median copy time
    copy_bytes: int  # size of one copy (read = write = copy_bytes)
    repeats: int
    median_ms: float
    method: str

    def as_dict(self) -> dict:
        return {
            "bytes_per_s": self.bytes_per_s,
            "gb_per_s": self.bytes_per_s / 1e9,
            "copy_bytes": self.copy_bytes,
            "repeats": self.repeats,
            "median_ms": self.median_ms,
            "method": self.method,
        }


def measure_copy_bandwidth(device: str, copy_bytes: int, repeats: int = 10) -> CopyBandwidth:
    if copy_bytes <= 0 or repeats <= 0:
        raise ValueError(f"copy_bytes and repeats must be > 0, got {copy_bytes}, {repeats}")
    dev = torch.device(device)
    n = copy_bytes // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page in both buffers
    times = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        method = "cuda device-to-device copy_ (CUDA events), read+write bytes"
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append((time.perf_counter() - t0) * 1e3)
        method = f"cpu memcpy via torch copy_ ({torch.get_num_threads()} threads), read+write bytes"
    med = statistics.median(times)
    nbytes = n * 4
    return CopyBandwidth(2 * nbytes / (med / 1e3), nbytes, repeats, med, method)
