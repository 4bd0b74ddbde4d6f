"""Other processes' share of the machine's CPU: on a 2-core box, a busy neighbour stalls every
multi-threaded op, so the benchmarks wait for quiet and report the share during their runs."""

from __future__ import annotations

import os
import time
from typing import Optional


class OtherLoad:
    """Share of the machine's CPU time other processes used over an interval (from /proc/stat): with
    two cores, another busy process stalls every multi-threaded op of ours until its thread runs.
    Children this process waited for count as its own (llama-bench, run by the benchmark)."""

    def __init__(self):
        self.start = self._now()

    @staticmethod
    def _now() -> Optional[tuple[float, float, float]]:
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(ticks) - ticks[3] - ticks[4]) / hz  # all but idle and iowait
        own = os.times()
        return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system

    def share(self) -> Optional[float]:
        end = self._now()
        if self.start is None or end is None:
            return None
        wall = (end[0] - self.start[0]) * (os.cpu_count() or 1)
        return max(0.0, ((end[1] - self.start[1]) - (end[2] - self.start[2])) / wall) if wall > 0 else None


def wait_for_quiet(max_wait: float, threshold: float = 0.15, interval: float = 0.5) -> None:
    """Wait (at most ``max_wait`` seconds) until other processes use less than ``threshold`` of the
    machine's CPU time: on a shared machine a run then measures the engine, not the neighbours."""
    deadline = time.perf_counter() + max_wait
    while time.perf_counter() < deadline:
        load = OtherLoad()
        time.sleep(interval)
        share = load.share()
        if share is None or share < threshold:
            return
