"""Sections for tests/test_gpu_check.py, run in gpu_check's worker processes (no torch: they start at once)."""

import os
import time


def hangs(ck):
    ck.run("quick", lambda: {"result": "done", "figure": 1.5, "unit": "x"})
    ck.share(seen_quick=True)
    ck.run("hangs", lambda: time.sleep(120))


def dies(ck):
    ck.run("before", lambda: {"result": "ok"})
    ck.run("dies", lambda: os._exit(7))
    ck.run("after", lambda: {"result": f"ctx seen: {ck.ctx.get('seen_quick')}"})
