"""How the benchmarks take a time: GPU time from timestamp queries, wall time, and the adapter's
ceilings (copy bandwidth, float32 fma and int8 dot-product rates) that figures are compared against.

Two wall times, for two questions:

* ``median_wall``: the latency of one call, the median of individually timed calls
  (each one followed by ``finish``).
* ``steady_wall``: the steady-state cost of a call when calls run back to back (one
  ``finish`` at the end), i.e. the total over the count: a mean by construction, which
  is what a pipelined device-resident loop costs per iteration.

Figures taken on a noisy host (the CPU drop-in step) come with ``median_interval``: how far
the median of a few samples can be trusted, with no assumption about their distribution.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

from ..runtime import Buffer, Recorder, get_device, kernel


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free interval for the median of what ``values`` sample: the order statistics
    x[k] and x[n + 1 − k] (1-based, sorted) with the largest k whose coverage,
    1 − 2·P(Binomial(n, ½) < k), is at least ``confidence`` (k = 1, the extremes, when no k reaches
    it: fewer than 6 values for 95%). Returns (low, high, coverage).

    >>> median_interval([1.06, 0.91, 1.27, 1.14, 0.95, 1.07])
    (0.91, 1.27, 0.96875)
    """
    xs = sorted(values)
    n = len(xs)
    if not n:
        raise ValueError("median_interval needs at least one value")

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0 ** n

    k = 1
    while k < (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def _nothing() -> None:
    pass


def median_wall(fn: Callable[[], None], iters: int, finish: Callable[[], None] = _nothing, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Median wall seconds of ``iters`` calls of ``fn``, each timed on its own up to the end
    of ``finish()`` (after ``warmup`` untimed calls)."""
    for _ in range(warmup):
        fn()
        finish()
    times = []
    for _ in range(iters):
        start = clock()
        fn()
        finish()
        times.append(clock() - start)
    return statistics.median(times)


def steady_wall(fn: Callable[[], None], iters: int, finish: Callable[[], None] = _nothing,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Wall seconds per call over ``iters`` back-to-back calls of ``fn`` and one ``finish()``
    at the end (after one untimed warm-up call): the steady-state mean, not a median."""
    fn()
    finish()
    start = clock()
    for _ in range(iters):
        fn()
    finish()
    return (clock() - start) / iters


def _timed_recordings(record: Callable[[Recorder], None], repeats: int, warmup: int,
                      per_dispatch: bool) -> list[tuple[Recorder, float | None]]:
    runs = []
    for i in range(warmup + repeats):
        rec = Recorder(timestamps=True, per_dispatch=per_dispatch)
        record(rec)
        seconds = rec.submit()
        if i >= warmup:
            runs.append((rec, seconds))
    return runs


def gpu_times(record: Callable[[Recorder], None], repeats: int, warmup: int = 2) -> list[float]:
    """GPU seconds of ``repeats`` recordings of ``record(rec)``, each submitted on its own
    after ``warmup`` untimed ones (compiles, pools, caches); empty without ``timestamp-query``."""
    return [seconds for _, seconds in _timed_recordings(record, repeats, warmup, False) if seconds is not None]


def kernel_times(record: Callable[[Recorder], None], repeats: int,
                 warmup: int = 2) -> list[list[tuple[str, float]]]:
    """Per launch (kernel name, GPU seconds) of ``repeats`` recordings of ``record(rec)``, after
    ``warmup`` untimed ones; each list is empty without ``timestamp-query``."""
    return [rec.kernel_times for rec, _ in _timed_recordings(record, repeats, warmup, True)]


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float | None:
    """Bytes/s of a GPU buffer-to-buffer copy (read + write counted), from timestamps."""
    device = get_device()
    if not device.has_timestamps:
        return None
    nbytes = min(nbytes, device.max_binding)
    src, dst = Buffer((nbytes // 4,)), Buffer((nbytes // 4,))
    k = kernel("copy.wgsl", "copy", device)
    grid = (min(device.max_workgroups, -(-nbytes // (16 * 256 * 4))), 1, 1)
    times = gpu_times(lambda rec: rec.dispatch(k, grid, (src, dst), (nbytes // 16,)), repeats, warmup=1)
    return 2 * nbytes / statistics.median(times)


PEAK_OPS_PER_STEP = 128  # peak.wgsl: flops (fma_chain) or int8 multiply-adds × 2 (dp4a_chain) a thread's loop step


def arithmetic_rate(entry: str, iters: int = 4096, workgroups: int | None = None, repeats: int = 10) -> float | None:
    """Operations/s of ``peak.wgsl``'s ``entry``: "fma_chain" (float32 flops, an fma counted as
    two) or "dp4a_chain" (int8 ops, each of a ``dot4I8Packed``'s four multiply-adds counted as
    two), from timestamps, over ``workgroups`` of 256 threads (default 4,096: enough to keep any
    GPU's cores busy; 64 with 256 steps on a CPU adapter, which is slow): the best of ``repeats``
    launches after as many unmeasured ones, since a GPU that was idle runs the first ones at a
    lower clock (``benchmarks/RESULTS.md``, "What is measured, and how"). None without timestamp
    queries.

    >>> # arithmetic_rate("fma_chain") / 1e12  # float32 TFLOP/s: RESULTS.md gives the H200's
    """
    device = get_device()
    if not device.has_timestamps:
        return None
    if device.is_cpu:
        workgroups, iters = workgroups or 64, min(iters, 256)
    workgroups = min(workgroups or 4096, device.max_workgroups)
    out = Buffer((workgroups * 256,), "u32", device)
    k = kernel("peak.wgsl", entry, device)
    times = gpu_times(lambda rec: rec.dispatch(k, (workgroups, 1, 1), (out,), (iters, 0)), repeats, warmup=repeats)
    return workgroups * 256 * iters * PEAK_OPS_PER_STEP / min(times)
