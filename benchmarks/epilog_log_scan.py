"""Epilog log-scan benchmark: a 1 GB job log with a GPU OOM at the end.

Run: ``.venv/bin/python benchmarks/epilog_log_scan.py [--size-mb 1024] [--dir /tmp]``

Writes a real (not sparse: sparse zeros would flatter the page cache) log of
training-like lines to a temporary file, then times three scans:
1. the epilog's default (tail 64 MiB, OOM at the end: early exit),
2. the same file with no OOM (the whole 64 MiB tail is searched: worst normal case),
3. the whole file as tail (raw throughput).
Prints seconds, MB/s over the bytes actually scanned, and peak RSS. Cleans up.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

from slurm_colloc.oom import scan_file
from slurm_colloc.oom.detector import DEFAULT_TAIL_BYTES

OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
    "total capacity of 39.38 GiB of which 1.58 GiB is free.\n"
)


def make_log(path: str, size: int, *, with_oom: bool) -> None:
    block = "".join(
        f"epoch 3 step {i:06d} loss 0.{i % 9973:04d} lr 3.0e-04 mem 12.1GiB "
        f"throughput 812.4 img/s data 0.012s\n"
        for i in range(4096)
    ).encode()
    with open(path, "wb") as f:
        written = 0
        while written < size:
            f.write(block)
            written += len(block)
        if with_oom:
            f.write(OOM.encode())


def timed(path: str, tail: int) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    r = scan_file(path, tail_bytes=tail)
    return time.perf_counter() - t0, r.bytes_scanned, r.cause


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    size = args.size_mb << 20
    fd, path = tempfile.mkstemp(prefix="colloc-bench-", suffix=".log", dir=args.dir)
    os.close(fd)
    try:
        make_log(path, size, with_oom=True)
        print(f"log: {os.path.getsize(path) / 1e6:.0f} MB at {path}")
        for label, tail in (
            ("default tail, OOM at end", DEFAULT_TAIL_BYTES),
            ("whole file as tail, OOM at end", size * 2),
        ):
            s, n, cause = timed(path, tail)
            print(
                f"{label:38s} {s:7.3f} s  {n / 1e6:8.1f} MB scanned  "
                f"{n / 1e6 / s:8.1f} MB/s  cause={cause}"
            )
        make_log(path, size, with_oom=False)
        for label, tail in (
            ("default tail, no OOM", DEFAULT_TAIL_BYTES),
            ("whole file as tail, no OOM", size * 2),
        ):
            s, n, cause = timed(path, tail)
            print(
                f"{label:38s} {s:7.3f} s  {n / 1e6:8.1f} MB scanned  "
                f"{n / 1e6 / s:8.1f} MB/s  cause={cause}"
            )
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"peak RSS {rss / 1024:.1f} MiB (whole process, includes the interpreter)")
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
