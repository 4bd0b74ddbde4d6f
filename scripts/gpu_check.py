"""Everything in llama-lite that needs CUDA, in one run of under 8 minutes on one GPU.

    python -m scripts.gpu_check [--out gpu_check.json] [--budget_s 450] [--fp8_peak_tflops T]
                                [--sections env,kernels,fp8_gemm,int4_demo,decode] [--work_dir DIR]

Sections, in the order they run (``--sections`` picks some; ``decode`` means the four decode ones):
  env        python / torch / CUDA / Triton versions, the GPU, whether the tokenizer is found, and a
             device-to-device copy of 1 GiB timed with CUDA events (bytes read + written): the HBM
             bandwidth the decode roofline is taken against, next to the datasheet's.
  kernels    the Triton kernels, compiled (TRITON_INTERPRET is removed from the workers' environment),
             against ``kernels.reference`` on the same inputs, through ``kernels.dispatch`` on the triton
             backend: linear, grouped_linear, grouped_swiglu and the dense swiglu of the shared expert,
             for every format of ``scripts.bench_triton.FORMATS`` at M = 1, 5, 33 and 512 (model dim
             5120, expert hidden 4096, 4 experts, one of them empty), with the tolerances of
             tests/kernels/test_triton.py (``TOLERANCES``); then each format's grouped_swiglu replayed from a CUDA graph against its
             eager result, and whether the fp8 x fp8 ``tl.dot`` compiled or fell back to bf16.
  fp8_gemm   the fp8 prefill GEMM: Triton's fp8 linear (with and without its activation quantization,
             checked against the reference) at 512 and 4096 tokens x 8192 x 5120 and its grouped_linear
             over 16 experts, next to torch._scaled_mm (rowwise scales) and a bf16 matmul: TFLOP/s and
             % of the dense peak of the GPU's datasheet (``DATASHEETS``; ``--fp8_peak_tflops`` overrides).
  int4_demo  ``python -m scripts.int4_demo --device cuda`` on its synthetic checkpoint (written and
             quantized beforehand, in the background): success, its tokens/s, the end of its output.
  decode_*   tokens/s of ``llama.generate`` at batch 1 and 8 (32 new tokens after a warm-up) for bf16
             and int4_mixed, built with compile=False and with compile=True (the decode step compiled
             at load, replayed from CUDA graphs: torch.compile's reduce-overhead), against the roofline: HBM bandwidth / weight bytes one decoding step
             reads (``scripts.benchmark.bytes_per_token``; at batch 8 the routed experts a uniform top-k
             routing is expected to hit). The model is the bench preset cut to ``--decode_layers``
             layers (3.6 GB at 4), written in the background while the kernels are checked.

Robustness. Every section runs in its own worker process, so a hang, a crash or a CUDA error that
poisons the context costs that section and not the run; each item inside it is caught on its own and
recorded with its one-line error and the tail of its traceback, and a worker that dies is started again
on the items it had not done. The time budget (``--budget_s``) is shared out between the sections still
to run (each keeps its minimum), checked between items, and enforced by killing a worker that overruns
its share. The JSON (``--out``) is rewritten after every item, so a kill loses nothing; the markdown
table goes to stdout at the end (on SIGTERM too), progress lines to stderr. Exit status: 0 when no item
failed, 1 otherwise, 2 without CUDA (one line, nothing run).

Only the standard library is imported at the top: a worker whose section needs no torch starts in a
fraction of a second, and the CPU tests run the machinery with sections of their own.
"""

import importlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
WORKER_COMMAND = "_worker"
GiB = 1024**3
MAX_RESTARTS = 2  # a worker that died is started again at most this many times
NEEDED_PACKAGES = ("torch", "fire", "fairscale", "safetensors", "tiktoken")

# tests/kernels/test_triton.py::test_matches_reference_module: kernel and reference round fp32 values that
# differ only in summation order to bf16 (at most 1 ulp apart), so |got - ref| <= rtol |ref| + atol * max|ref|
# element by element; SwiGLU rounds its hidden activations to bf16 (and for fp8 / w4a8 / nvfp4 activations
# quantizes them again), where a one-ulp flip can move a code: the looser pair.
TOLERANCES = {  # op -> (rtol, atol as a fraction of max |ref|)
    "linear": (2**-7, 2**-12),
    "grouped_linear": (2**-7, 2**-12),
    "grouped_swiglu": (2**-6, 2**-7),
    "swiglu": (2**-6, 2**-7),
}
KERNEL_OPS = tuple(TOLERANCES)

# NVIDIA's datasheets print tensor-core rates "with sparsity" (2:4); dense rates are half of them.
# (substring of torch.cuda.get_device_name(), fp8 TFLOP/s with sparsity, bf16 TFLOP/s with sparsity,
#  HBM TB/s, datasheet), most specific names first.
DATASHEETS = (
    ("GH200", 3958, 1979, None, "NVIDIA GH200 Grace Hopper Superchip datasheet"),
    ("H200 NVL", 3341, 1671, 4.8, "NVIDIA H200 NVL datasheet"),
    ("H200", 3958, 1979, 4.8, "NVIDIA H200 SXM datasheet"),
    ("H100 NVL", 3341, 1671, 3.9, "NVIDIA H100 NVL datasheet"),
    ("H100 PCIe", 3026, 1513, 2.0, "NVIDIA H100 PCIe datasheet"),
    ("H100", 3958, 1979, 3.35, "NVIDIA H100 SXM datasheet"),
)

_T0 = time.time()
_CHILD_GROUPS: list[int] = []  # process groups a worker started (run_process)


def log(message: str) -> None:
    print(f"[gpu_check {time.time() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def one_line(text: Any, limit: int = 400) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def error_fields(err: BaseException) -> dict:
    """An error row's fields: one line, and the last lines of the traceback."""
    lines = "".join(traceback.format_exception(type(err), err, err.__traceback__)).strip().splitlines()
    return {"status": "error", "error": one_line(f"{type(err).__name__}: {err}"), "traceback": lines[-8:]}


class DeviceLost(Exception):
    """CUDA stopped working in this process (e.g. after an illegal memory access): nothing more runs here."""

    def __init__(self, message: str, detail: Any = None):
        super().__init__(message)
        self.detail = detail


def device_lost() -> Optional[DeviceLost]:
    """A DeviceLost if this process initialised CUDA and can no longer use it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return None
    except Exception as err:  # noqa: BLE001 -- whatever CUDA says, the context is gone
        return DeviceLost(f"CUDA is unusable in this process: {one_line(err)}")


# ----------------------------------------------------------------------------------------------
# what a section function gets


class Check:
    """A section's view of the run: shared values (``ctx``), its deadline, and ``run``, which records one
    item. Section functions are ``fn(ck, **kwargs)``; they call ``ck.run(item, fn)`` per item."""

    def __init__(self, section: str, ctx: dict, deadline: float, emit: Callable[[dict], None], done=()):
        self.section, self.ctx, self.deadline, self._emit = section, ctx, deadline, emit
        self.done = set(done)  # items an earlier attempt of this section recorded
        self.not_run: list[str] = []

    @property
    def device(self):
        import torch

        return torch.device(self.ctx.get("device", "cuda"))

    def time_left(self) -> float:
        return self.deadline - time.time()

    def share(self, **values) -> None:
        """Values later sections see in their ``ctx`` (JSON types only)."""
        self.ctx.update(values)
        self._emit({"ctx": values})

    def spawned(self, pid: int) -> None:
        """A process group this worker started: the runner (or the watchdog) kills it with the worker."""
        _CHILD_GROUPS.append(pid)
        self._emit({"child": pid})

    def run(self, item: str, fn: Callable[[], Optional[dict]]) -> Any:
        """Run ``fn`` and record its row; returns the row's ``value`` (not recorded), None if it raised.

        ``fn`` returns the row's fields: status (default pass), result (text), figure + unit, pct +
        pct_of (% of a peak or roofline), detail (anything JSON), value. An exception becomes an error
        row; if CUDA is then unusable, DeviceLost ends the worker (the runner starts a new one).
        """
        if item in self.done:
            return None
        if self.time_left() <= 0:
            self.not_run.append(item)
            return None
        self._emit({"start": item})
        start, lost = time.perf_counter(), None
        try:
            fields = dict(fn() or {})
        except DeviceLost as err:
            fields, lost = {**error_fields(err), "detail": err.detail}, err
        except Exception as err:  # noqa: BLE001 -- one item's failure is a result, not the end of the run
            fields, lost = error_fields(err), device_lost()
        value = fields.pop("value", None)
        row = {"section": self.section, "item": item, "status": "pass", **fields,
               "seconds": round(time.perf_counter() - start, 3)}  # fmt: skip
        self._emit({"row": row})
        log(f"{self.section}: {item}: {row['status']} ({row['seconds']:.1f} s) {one_line(row_text(row), 120)}")
        if lost is not None:
            raise lost
        return value

    def finish(self) -> None:
        if self.not_run:
            self._emit({"row": {
                "section": self.section, "item": f"{len(self.not_run)} item(s) not run", "status": "skipped",
                "result": "the section's time ran out before: " + ", ".join(self.not_run),
            }})  # fmt: skip


def row_text(row: dict) -> str:
    return str(row.get("result") or row.get("error") or "")


# ----------------------------------------------------------------------------------------------
# worker processes


def resolve(target: str) -> Callable:
    """``package.module:function`` or ``path/to/file.py:function``."""
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _watchdog(parent: int, hard_deadline: float) -> None:
    """A worker has a session of its own, which outlives the command that ran the check: if the runner
    is gone (killed outright) or the worker overstays its time, it ends itself and what it started."""
    while os.getppid() == parent and time.time() < hard_deadline:
        time.sleep(0.5)
    for pgid in [*_CHILD_GROUPS, os.getpgid(0)]:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def worker_main(spec_path: str) -> int:
    """Run one section as the runner's spec file says, its events appended to a JSON-lines file."""
    global _T0
    spec = json.loads(Path(spec_path).read_text())
    _T0 = spec["t0"]
    threading.Thread(target=_watchdog, args=(spec["parent"], spec["hard_deadline"]), daemon=True).start()
    events = open(spec["events"], "a", buffering=1)

    def emit(event: dict) -> None:
        events.write(json.dumps(event, default=str) + "\n")
        events.flush()

    ck = Check(spec["section"], spec["ctx"], spec["deadline"], emit, spec["done"])
    try:
        resolve(spec["target"])(ck, **spec["kwargs"])
        ck.finish()
        emit({"end": True})
        return 0
    except DeviceLost as err:
        emit({"lost": one_line(err)})
        return 3
    except Exception as err:  # noqa: BLE001 -- reported to the runner, which goes on
        emit({"section_error": error_fields(err)})
        return 1


class Worker:
    """One attempt at one section in a process of its own (its own process group, so a kill takes
    whatever it started along). Output is echoed to stderr, prefixed, and its tail kept."""

    def __init__(self, section: "Section", attempt: int, tmp: Path, ctx: dict, deadline: float, done, t0: float):
        self.section, self.deadline = section, deadline
        self.events_path = tmp / f"{section.name}.{attempt}.events"
        spec_path = tmp / f"{section.name}.{attempt}.json"
        soft = deadline - min(10.0, 0.15 * max(0.0, deadline - time.time()))  # stop starting items before the kill
        spec_path.write_text(json.dumps({
            "section": section.name, "target": section.target, "kwargs": section.kwargs, "ctx": ctx,
            "deadline": soft, "done": sorted(done), "events": str(self.events_path), "t0": t0,
            "parent": os.getpid(), "hard_deadline": deadline + 15,
        }, default=str))  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, always
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scripts.gpu_check", WORKER_COMMAND, str(spec_path)], cwd=ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", start_new_session=True,
        )  # fmt: skip
        self.children: list[int] = []
        self.tail: deque = deque(maxlen=30)
        self.killed = False
        self._pos, self._partial = 0, b""
        self._pump = threading.Thread(target=self._echo, daemon=True)
        self._pump.start()

    def _echo(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            print(f"    {self.section.name} | {line}", file=sys.stderr, flush=True)

    def events(self) -> list[dict]:
        try:
            with open(self.events_path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self._pos += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def kill(self) -> None:
        self.killed = True
        for pgid in [self.proc.pid, *self.children]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        self._pump.join(timeout=5)

    def finished(self) -> Optional[int]:
        rc = self.proc.poll()
        if rc is not None:
            self._pump.join(timeout=5)
        return rc


def run_process(cmd: list[str], timeout: float, env: Optional[dict] = None, ck: Optional[Check] = None):
    """(exit status, stdout + stderr, timed out) of ``cmd`` run in a process group of its own, which is
    killed whole at the timeout (a plain subprocess.run would leave its children holding the pipe)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    if ck is not None:
        ck.spawned(proc.pid)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return proc.returncode, out, True


# ----------------------------------------------------------------------------------------------
# the runner


@dataclass
class Section:
    name: str
    title: str
    target: Any  # "module:function" (or "file.py:function"), run in a worker; a callable runs in this process
    kwargs: dict = field(default_factory=dict)
    cap_s: float = 120.0  # the most this section may take
    min_s: float = 10.0  # what it is kept when the budget is shared out (and the least worth starting it with)
    background: bool = False  # started at the beginning, beside the others (CPU work: checkpoints)
    after: tuple = ()  # background sections to wait for first


class Interrupted(Exception):
    """SIGTERM: finish the report and stop."""


def _interrupt(signum, frame):
    raise Interrupted(f"signal {signum}")


class Runner:
    """Runs sections under one time budget and keeps ``out`` (JSON) up to date after every event."""

    def __init__(self, sections: list[Section], out, budget_s: float, ctx: dict, tick_s: float = 0.2):
        self.sections, self.out, self.budget_s, self.ctx, self.tick_s = sections, Path(out), budget_s, ctx, tick_s
        self.t0 = time.time()
        self.end = self.t0 + budget_s
        self.recs = {s.name: {"name": s.name, "title": s.title, "status": "pending", "background": s.background,
                              "rows": [], "attempts": 0} for s in sections}  # fmt: skip
        self.workers: dict[str, Worker] = {}
        import tempfile

        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check-"))  # the workers' spec and event files
        self.report = {
            "tool": "python -m scripts.gpu_check", "argv": sys.argv[1:], "started": time.strftime(
                "%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.t0)), "budget_s": budget_s, "elapsed_s": 0.0,
            "finished": False, "interrupted": False, "ctx": ctx, "tolerances": {
                op: {"rtol": r, "atol_of_max_ref": a} for op, (r, a) in TOLERANCES.items()},
            "sections": list(self.recs.values()), "summary": {}, "markdown": "",
        }  # fmt: skip

    # --- bookkeeping
    def write(self) -> None:
        self.report["elapsed_s"] = round(time.time() - self.t0, 1)
        self.report["summary"] = summary(self.report)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        os.replace(tmp, self.out)

    def _event(self, rec: dict, event: dict, worker: Optional[Worker] = None) -> None:
        if "start" in event:
            rec["in_flight"] = event["start"]
            return
        if "row" in event:
            rec["rows"].append(event["row"])
            rec["in_flight"] = None
        elif "ctx" in event:
            self.ctx.update(event["ctx"])
        elif "child" in event and worker is not None:
            worker.children.append(event["child"])
        elif "section_error" in event:
            rec.update(event["section_error"])
        elif "end" in event:
            rec["ended"] = True
        elif "lost" in event:
            rec["lost"] = event["lost"]
        self.write()

    def _close(self, rec: dict, status: Optional[str] = None) -> None:
        rec.pop("in_flight", None)
        rec["status"] = status or section_status(rec)
        started = rec.get("started_s")
        rec["elapsed_s"] = 0.0 if started is None else round(time.time() - self.t0 - started, 1)
        log(f"section {rec['name']}: {rec['status']} ({rec['elapsed_s']:.0f} s, {len(rec['rows'])} rows)")
        self.write()

    # --- time
    def _later_minimum(self, section: Section) -> float:
        names = [s.name for s in self.sections]
        later = self.sections[names.index(section.name) + 1 :]
        return sum(s.min_s for s in later if not s.background and self.recs[s.name]["status"] == "pending")

    def _share(self, section: Section) -> float:
        left = self.end - time.time()
        if section.background:
            return min(section.cap_s, left)
        return min(section.cap_s, max(left - self._later_minimum(section), min(section.min_s, left)))

    # --- running
    def run(self) -> dict:
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _interrupt) if in_main else None
        completed = False
        try:
            self.write()
            for s in self.sections:
                if s.background:
                    self._start(s)
            for s in self.sections:
                if not s.background:
                    self._foreground(s)
            while any(w.proc.poll() is None for w in self.workers.values()):
                self._tick()
            self._tick()
            completed = True
        except (Interrupted, KeyboardInterrupt) as err:
            log(f"interrupted ({err or 'Ctrl-C'}): writing what was measured")
            self.report["interrupted"] = True
            for name, w in list(self.workers.items()):
                w.kill()
                self._absorb(name, w)
                rec = self.recs[name]
                if rec.get("in_flight"):
                    rec["rows"].append({"section": name, "item": rec["in_flight"], "status": "error",
                                        "error": f"interrupted ({err or 'Ctrl-C'})"})  # fmt: skip
                self._close(rec, "interrupted")
            self.workers.clear()
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, previous)
            for name, w in list(self.workers.items()):  # nothing outlives the run
                w.kill()
            self.report["finished"] = completed  # False also when the runner itself failed
            self.report["summary"] = summary(self.report)
            self.report["markdown"] = markdown(self.report)
            self.write()
            shutil.rmtree(self.tmp, ignore_errors=True)
        return self.report

    def _start(self, section: Section, done=()) -> bool:
        rec = self.recs[section.name]
        share = self._share(section)
        if share < min(3.0, section.min_s):
            rec["rows"].append({"section": section.name, "item": "(not run)", "status": "skipped",
                                "result": "the time budget was spent"})  # fmt: skip
            self._close(rec, "skipped")
            return False
        rec["attempts"] += 1
        rec.setdefault("started_s", round(time.time() - self.t0, 1))
        rec["status"], rec["timeout_s"] = "running", round(share, 1)
        log(f"section {section.name}: {section.title} (up to {share:.0f} s)")
        deadline = time.time() + share
        if callable(section.target):  # in this process (tests): no isolation, no kill
            ck = Check(section.name, self.ctx, deadline, lambda ev: self._event(rec, ev), done)
            try:
                section.target(ck, **section.kwargs)
                ck.finish()
            except Exception as err:  # noqa: BLE001
                rec.update(error_fields(err))
            self._close(rec)
            return True
        self.workers[section.name] = Worker(section, rec["attempts"], self.tmp, self.ctx, deadline, done, self.t0)
        self.write()
        return True

    def _foreground(self, section: Section) -> None:
        for dep in section.after:
            while dep in self.workers and time.time() < self.end - section.min_s:
                self._tick()
        if self._start(section):
            while section.name in self.workers:
                self._tick()

    def _absorb(self, name: str, worker: Worker) -> None:
        for event in worker.events():
            self._event(self.recs[name], event, worker)

    def _tick(self) -> None:
        time.sleep(self.tick_s)
        for name, w in list(self.workers.items()):
            self._absorb(name, w)
            rc = w.finished()
            if rc is None and time.time() > w.deadline:
                log(f"section {name}: over its {self.recs[name]['timeout_s']:.0f} s, killing its worker")
                w.kill()
                rc = w.proc.returncode
            if rc is not None:
                self._absorb(name, w)
                del self.workers[name]
                self._ended(w, rc)

    def _ended(self, w: Worker, rc: int) -> None:
        section = w.section
        rec = self.recs[section.name]
        rec["returncode"] = rc
        rec["log_tail"] = list(w.tail)[-15:]
        lost = rec.pop("lost", None)
        if rec.pop("ended", False) or ("error" in rec and not lost):  # done, or the section function raised
            self._close(rec)
            return
        item = rec.get("in_flight")
        if w.killed:
            why = f"killed at the section's time limit ({rec['timeout_s']:.0f} s)"
        else:
            why = lost or f"the worker process died (exit status {rc})"
        if item:  # what it was doing when it died is that item's result
            rec["rows"].append({"section": section.name, "item": item, "status": "error", "error": why,
                                "traceback": list(w.tail)[-8:]})  # fmt: skip
        # Each attempt that ends this way has recorded at least one more item (the one in flight, or the
        # one whose error lost the device), so starting again on the others always progresses.
        if not w.killed and (item or lost) and rec["attempts"] <= MAX_RESTARTS:
            log(f"section {section.name}: {why}; starting it again on the items not done")
            if self._start(section, done={r["item"] for r in rec["rows"]}):
                return
        rec.setdefault("error", why)
        self._close(rec, "timeout" if w.killed else None)


def section_status(rec: dict) -> str:
    statuses = {r.get("status") for r in rec["rows"]}
    if rec.get("error") or "error" in statuses:
        return "error"
    if "fail" in statuses:
        return "fail"
    if statuses and statuses <= {"skipped"}:
        return "skipped"
    return "pass"


def summary(report: dict) -> dict:
    counts = {s: 0 for s in ("pass", "fail", "error", "skipped", "info")}
    for rec in report["sections"]:
        for r in rec["rows"]:
            counts[r.get("status", "info")] = counts.get(r.get("status", "info"), 0) + 1
        if rec.get("error") and not any(r.get("status") == "error" for r in rec["rows"]):
            counts["error"] += 1  # a section-level error with no error row of its own
    return counts


# ----------------------------------------------------------------------------------------------
# the table


def _cell(text: Any) -> str:
    return one_line(text, 160).replace("|", "\\|")


def _figure(row: dict) -> str:
    v = row.get("figure")
    return "" if v is None else f"{v:.4g} {row.get('unit', '')}".strip()


def _pct(row: dict) -> str:
    p = row.get("pct")
    return "" if p is None else f"{p:.1f}% of {row.get('pct_of', '')}".strip()


def markdown(report: dict) -> str:
    ctx, s = report["ctx"], report["summary"]
    head = (f"gpu_check on {ctx.get('gpu_name', 'an unknown GPU')}: {report['elapsed_s']:.0f} s of a "
            f"{report['budget_s']:.0f} s budget{', interrupted' if report['interrupted'] else ''}; "
            + ", ".join(f"{n} {k}" for k, n in s.items() if n))  # fmt: skip
    lines = [head, "", "| section | item | result | figure | % of peak / roofline | status |",
             "|---|---|---|---:|---:|---|"]  # fmt: skip
    for rec in report["sections"]:
        rows = list(rec["rows"])
        if rec.get("error") and not any(r.get("status") == "error" for r in rows):
            rows.append({"item": "(section)", "status": "error", "error": rec["error"]})
        if not rows and rec["status"] not in ("pass", "pending"):
            rows.append({"item": "(section)", "status": rec["status"], "result": ""})
        for r in rows:
            lines.append(f"| {rec['name']} | {_cell(r.get('item', ''))} | {_cell(row_text(r))} | {_cell(_figure(r))} "
                         f"| {_cell(_pct(r))} | {r.get('status', '')} |")  # fmt: skip
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# measuring helpers (torch imported inside: the runner itself never touches CUDA)


class _WallTimer:
    """``scripts.bench_triton.Timer``'s ``eager`` on a CPU (the tests): median wall time in ms."""

    def __init__(self, reps: int, warmup: int):
        self.reps, self.warmup = reps, warmup

    def eager(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)


def make_timer(device, reps: int = 10, warmup: int = 3):
    """CUDA events with the L2 flushed before each repetition on a GPU (bench_triton's Timer), wall time on a CPU."""
    if device.type == "cuda":
        from scripts.bench_triton import Timer

        return Timer(reps, warmup, graphs=False)
    return _WallTimer(reps, warmup)


def copy_bandwidth(device, nbytes: int, timer) -> float:
    """GB/s of a device-to-device copy of ``nbytes``, counting the bytes read and the bytes written."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer.eager(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / ms / 1e6


def datasheet(gpu_name: Optional[str]) -> Optional[dict]:
    for key, fp8, bf16, hbm, source in DATASHEETS:
        if gpu_name and key in gpu_name:
            return {"key": key, "fp8_sparse": fp8, "bf16_sparse": bf16, "hbm_tbs": hbm, "source": source}
    return None


def peak_tflops(ctx: dict, kind: str) -> tuple[Optional[float], str]:
    """(dense TFLOP/s, where the figure comes from) for ``kind`` fp8 or bf16 on ctx's GPU."""
    if kind == "fp8" and ctx.get("fp8_peak_tflops"):
        return float(ctx["fp8_peak_tflops"]), "--fp8_peak_tflops"
    sheet = datasheet(ctx.get("gpu_name"))
    if sheet is None:
        return None, f"no datasheet figure for {ctx.get('gpu_name')!r}; pass --fp8_peak_tflops"
    sparse = sheet[f"{kind}_sparse"]
    return sparse / 2, f"{sheet['source']}: {sparse:,} TFLOP/s {kind} with sparsity, {sparse / 2:,g} dense"


def expert_offsets(m: int, experts: int) -> list[int]:
    """Offsets of ``m`` rows over ``experts`` (>= 3): half to the first, none to the second, the rest
    spread over the others -- an empty expert and uneven ones in every grouped call."""
    counts = [0] * experts
    counts[0] = (m + 1) // 2
    rest, others = m - counts[0], experts - 2
    for i in range(others):
        counts[2 + i] = rest // others + (1 if i < rest % others else 0)
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets


def compare(got, want, rtol: float, atol_frac: float) -> dict:
    """Element-wise |got - want| <= rtol |want| + atol_frac max|want| (torch.testing.assert_close's rule)."""
    import torch

    got, want = got.float(), want.float()
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs()
    bound = rtol * want.abs() + atol_frac * scale
    finite = bool(torch.isfinite(got).all())
    ok = finite and scale > 0 and bool((err <= bound).all())
    worst = (err / bound.clamp_min(1e-30)).max().item() if err.numel() else 0.0
    return {"ok": ok, "finite": finite, "max_err_of_max_ref": err.max().item() / scale if scale else None,
            "worst_err_over_bound": worst, "max_ref": scale}  # fmt: skip


def kernel_api(impl: str):
    """``kernels.dispatch`` on backend ``impl`` (triton on the GPU; cpu in the tests)."""
    from kernels import dispatch

    dispatch.set_backend(impl)
    return dispatch


def call_op(api, op: str, x, offsets, w: dict):
    if op == "linear":
        return api.linear(x, w["d1"])
    if op == "grouped_linear":
        return api.grouped_linear(x, offsets, w["w1"])
    if op == "grouped_swiglu":
        return api.grouped_swiglu(x, offsets, w["w1"], w["w3"], w["w2"])
    return api.swiglu(x, w["d1"], w["d3"], w["d2"])


def kernel_weights(fmt: str, experts: int, dim: int, hidden: int, dev, gen) -> dict:
    """W1, W3 [E, hidden, dim] and W2 [E, dim, hidden] in ``fmt`` (bench_triton's random weights), and
    expert 0 of each as a dense weight."""
    from kernels.formats import select_expert
    from scripts.bench_triton import make_weights

    w1, w3, w2 = (make_weights(fmt, experts, n, k, dev, gen) for n, k in ((hidden, dim), (hidden, dim), (dim, hidden)))
    if fmt == "nvfp4_act":
        w3.input_global_scale = w1.input_global_scale  # one calibration for W1 and W3, as a loader gives
    return {"w1": w1, "w3": w3, "w2": w2, "d1": select_expert(w1, 0), "d3": select_expert(w3, 0),
            "d2": select_expert(w2, 0)}  # fmt: skip


def activations(m: int, k: int, dev, gen):
    import torch

    x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.float32) * 2
    if m > 2:
        x[2, 3] = 5000.0  # a token past the fp8 activation-scale bound (1200)
    return x.to(torch.bfloat16)


def gpu_info(dev) -> dict:
    import torch

    p = torch.cuda.get_device_properties(dev)
    info = {"name": p.name, "capability": list(torch.cuda.get_device_capability(dev)),
            "memory_gib": round(p.total_memory / GiB, 1), "sms": p.multi_processor_count}  # fmt: skip
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)  # fmt: skip
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        info["nvidia_smi"] = one_line(err)
    return info


# ----------------------------------------------------------------------------------------------
# sections


def section_env(ck: Check, copy_bytes: int = GiB, reps: int = 10) -> None:
    import platform

    import torch

    dev = ck.device

    def versions():
        try:
            import triton

            tv = triton.__version__
        except Exception as err:  # noqa: BLE001
            tv = f"not importable ({one_line(err, 80)})"
        ck.share(torch=torch.__version__, triton=tv)
        return {"status": "info", "result": f"python {platform.python_version()}, torch {torch.__version__} "
                f"(CUDA {torch.version.cuda}), triton {tv}"}  # fmt: skip

    def gpu():
        if dev.type != "cuda":
            return {"status": "skipped", "result": f"the device is {dev}, not a GPU"}
        info = gpu_info(dev)
        ck.share(gpu_name=info["name"], capability=info["capability"])
        cap = info["capability"]
        return {"status": "info", "detail": info, "result": f"{info['name']}, sm_{cap[0]}{cap[1]}, "
                f"{info['memory_gib']} GiB, {info['sms']} SMs; nvidia-smi: {info['nvidia_smi']}"}  # fmt: skip

    def interpret():
        caller = ck.ctx.get("caller_triton_interpret")
        now = os.environ.get("TRITON_INTERPRET")
        note = f" (the caller's environment had TRITON_INTERPRET={caller})" if caller else ""
        what = "the kernels would be interpreted" if now == "1" else "the kernels are compiled"
        return {"status": "fail" if now == "1" else "info",
                "result": f"TRITON_INTERPRET={now!r} in the workers: {what}{note}"}

    def bandwidth():
        bw = copy_bandwidth(dev, copy_bytes, make_timer(dev, reps))
        ck.share(hbm_gbps=round(bw, 1))
        sheet = datasheet(ck.ctx.get("gpu_name"))
        hbm = sheet and sheet["hbm_tbs"]
        return {"status": "info", "figure": bw, "unit": "GB/s", "pct": 100 * bw / (hbm * 1e3) if hbm else None,
                "pct_of": f"{hbm} TB/s ({sheet['source']})" if hbm else "",
                "result": f"copy of {copy_bytes / GiB:.3g} GiB, median of {reps}; the decode roofline's bandwidth"}

    def tokenizer():
        from llama_lite.tokenizer import default_tokenizer_path

        return {"status": "info", "result": f"{default_tokenizer_path()} (the synthetic checkpoints copy it)"}

    ck.run("versions", versions)
    ck.run("GPU", gpu)
    ck.run("TRITON_INTERPRET", interpret)
    ck.run("HBM copy bandwidth (read + write)", bandwidth)
    ck.run("Llama 4 tokenizer", tokenizer)


def section_kernels(ck: Check, impl: str = "triton", formats=None, ms=(1, 5, 33, 512), dim: int = 5120,
                    hidden: int = 4096, experts: int = 4, seed: int = 0) -> None:  # fmt: skip
    """Each op and format against the reference at every M. hidden 4096: W1 / W3 (N 4096) and W2
    (N 5120) take the same tiles (the decode tile's BLOCK_N changes at N = 4096), so fewer variants
    compile, and the fp8_gemm section's shapes reuse the prefill tile compiled here."""
    import torch

    from kernels import reference
    from scripts.bench_triton import FORMATS

    dev = ck.device
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 matmuls stay fp32
    api = kernel_api(impl)
    if impl == "triton":
        def compiled():
            if os.environ.get("TRITON_INTERPRET", "0") == "1":
                raise RuntimeError("TRITON_INTERPRET=1: the kernels would be interpreted")
            tk = importlib.import_module("kernels.triton_kernels")
            kind = type(tk._gemm_kernel).__name__
            return {"status": "fail" if kind == "InterpretedFunction" else "pass",
                    "result": f"_gemm_kernel is a {kind}: compiled for {dev} at its first launch"}  # fmt: skip

        ck.run("Triton kernels compiled, not interpreted", compiled)
    gen = torch.Generator(device=dev).manual_seed(seed)
    xs = {m: activations(m, dim, dev, gen) for m in ms}
    offsets = {m: torch.tensor(expert_offsets(m, experts), device=dev) for m in ms}
    weights: dict[str, dict] = {}

    def get_weights(fmt: str) -> dict:
        if fmt not in weights:
            weights.clear()  # one format at a time in memory
            weights[fmt] = kernel_weights(fmt, experts, dim, hidden, dev, gen)
        return weights[fmt]

    def check(op: str, fmt: str) -> dict:
        rtol, atol = TOLERANCES[op]
        w = get_weights(fmt)
        per_m, parts = {}, []
        for m in ms:
            try:
                got = call_op(api, op, xs[m], offsets[m], w)
                want = call_op(reference, op, xs[m], offsets[m], w)
                per_m[m] = compare(got, want, rtol, atol)
            except Exception as err:  # noqa: BLE001 -- the other sizes still say something
                per_m[m] = {"ok": False, "error": one_line(f"{type(err).__name__}: {err}")}
                lost = device_lost()
                if lost is not None:
                    lost.detail = per_m
                    raise lost from err
        errors = [m for m, r in per_m.items() if "error" in r]
        bad = [m for m, r in per_m.items() if not r["ok"] and "error" not in r]
        worst = max((r["max_err_of_max_ref"] or 0 for r in per_m.values() if "error" not in r), default=None)
        for m, r in per_m.items():
            err = r.get("max_err_of_max_ref")
            text = r["error"] if "error" in r else ("all-zero reference" if err is None else f"{err:.1e}")
            parts.append(f"M={m} {text}{'' if r['ok'] or 'error' in r else ' MISMATCH'}")
        status = "error" if errors else "fail" if bad else "pass"
        return {"status": status, "figure": worst, "unit": "of max |ref|", "detail": per_m,
                "result": "max |err| / max|ref|: " + "; ".join(parts) + f" (tol {rtol:g} |ref| + {atol:g} max|ref|)",
                **({"error": f"raised at M={errors}: {per_m[errors[0]]['error']}"} if errors else {})}

    def graph_replay(fmt: str) -> dict:
        """The decode step of a CUDA graph: grouped_swiglu captured once, replayed on new inputs."""
        w, m = get_weights(fmt), ms[1] if len(ms) > 1 else ms[0]
        static = xs[m].clone()
        call_op(api, "grouped_swiglu", static, offsets[m], w)  # compiled and warm before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call_op(api, "grouped_swiglu", static, offsets[m], w)
        fresh = activations(m, dim, dev, gen)
        static.copy_(fresh)
        graph.replay()
        want = call_op(api, "grouped_swiglu", fresh, offsets[m], w)
        torch.cuda.synchronize()
        same = torch.equal(out, want)
        return {"status": "pass" if same else "fail",
                "result": f"M={m}: replay {'equals' if same else 'DIFFERS from'} the eager call on the same input"}

    for fmt in formats or FORMATS:
        for op in KERNEL_OPS:
            ck.run(f"{op} {fmt}", lambda op=op, fmt=fmt: check(op, fmt))
    if dev.type == "cuda":
        for fmt in formats or FORMATS:
            ck.run(f"CUDA graph replay: grouped_swiglu {fmt}", lambda fmt=fmt: graph_replay(fmt))
    weights.clear()
    if impl == "triton" and dev.type == "cuda":
        def fp8_dot():
            tk = importlib.import_module("kernels.triton_kernels")
            cap = torch.cuda.get_device_capability(dev)
            if cap < (8, 9):
                return {"status": "skipped", "result": f"sm_{cap[0]}{cap[1]} has no fp8 MMA"}
            broken = tk._fp8_dot_broken
            return {"status": "fail" if broken else "pass", "result": "fell back to bf16 operands (see the log)"
                    if broken else "fp8 x fp8 tl.dot compiled and ran (fp8 tensor-core path)"}  # fmt: skip

        ck.run("fp8 x fp8 tl.dot", fp8_dot)


def _gemm_fields(ms: float, flops: float, peak: tuple, note: str = "") -> dict:
    tflops = flops / (ms * 1e-3) / 1e12
    value, source = peak
    return {"status": "info", "result": f"{ms:.3f} ms{note}", "figure": tflops, "unit": "TFLOP/s",
            "pct": 100 * tflops / value if value else None, "pct_of": f"{value:g} TFLOP/s dense" if value else "",
            "detail": {"ms": ms, "peak_source": source}}  # fmt: skip


def section_fp8_gemm(ck: Check, shapes=((512, 8192, 5120), (4096, 8192, 5120)), experts: int = 16, reps: int = 10,
                     impl: str = "triton", seed: int = 0) -> None:  # fmt: skip
    import torch

    from kernels import reference
    from kernels.formats import select_expert
    from scripts.bench_triton import make_weights, route

    dev = ck.device
    if dev.type == "cuda" and not ck.ctx.get("gpu_name"):
        ck.share(gpu_name=torch.cuda.get_device_name(dev))
    fp8_peak, bf16_peak = peak_tflops(ck.ctx, "fp8"), peak_tflops(ck.ctx, "bf16")
    ck.share(fp8_peak=fp8_peak, bf16_peak=bf16_peak)
    api, timer = kernel_api(impl), make_timer(dev, reps)
    gen = torch.Generator(device=dev).manual_seed(seed)
    rtol, atol = TOLERANCES["linear"]

    def triton_linear(x, w, flops):
        ms = timer.eager(lambda: api.linear(x, w))
        fields = _gemm_fields(ms, flops, fp8_peak, ", activation quantization included")
        c = compare(api.linear(x, w), reference.linear(x, w), rtol, atol)
        fields.update(status="pass" if c["ok"] else "fail", detail={**fields["detail"], "vs_reference": c})
        fields["result"] += f"; max |err| {c['max_err_of_max_ref']:.1e} of max|ref|"
        return fields

    def gemm_only(x, w, flops):
        tk = importlib.import_module("kernels.triton_kernels")
        op = tk._operands(w)
        aq, scale = tk._quantize_activations(x, w, None)
        out = torch.empty(x.shape[0], op.n, dtype=x.dtype, device=dev)
        ms = timer.eager(lambda: tk._launch_gemm(aq, scale, op, None, out, None, grouped=False))
        return _gemm_fields(ms, flops, fp8_peak, ", activations quantized beforehand")

    def scaled_mm(x, w, flops):
        xs = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
        a, b = (x.float() / xs).to(torch.float8_e4m3fn), w.weight.t()  # b: [K, N] column-major
        try:
            scales, kind = (xs, w.scale.float().reshape(1, -1)), "rowwise scales"
            torch._scaled_mm(a, b, scale_a=scales[0], scale_b=scales[1], out_dtype=torch.bfloat16)
        except Exception as err:  # noqa: BLE001 -- older torch / GPUs: tensor-wise scales only
            one = torch.ones((), device=dev)
            scales, kind = (one, one), f"tensor-wise scales (rowwise refused: {one_line(err, 100)})"
        ms = timer.eager(lambda: torch._scaled_mm(a, b, scale_a=scales[0], scale_b=scales[1], out_dtype=torch.bfloat16))
        return _gemm_fields(ms, flops, fp8_peak, f", {kind}, activations quantized beforehand")

    def bf16_matmul(x, n, k, flops):
        wb = torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16)
        return _gemm_fields(timer.eager(lambda: x @ wb.t()), flops, bf16_peak, " (vs the bf16 dense peak)")

    for m, n, k in shapes:
        flops, shape = 2 * m * n * k, f"{m}x{n}x{k}"
        w = select_expert(make_weights("fp8", 1, n, k, dev, gen), 0)
        x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
        ck.run(f"Triton fp8 linear {shape}", lambda: triton_linear(x, w, flops))  # noqa: B023 -- run at once
        if impl == "triton":
            ck.run(f"Triton fp8 GEMM only {shape}", lambda: gemm_only(x, w, flops))  # noqa: B023
        ck.run(f"torch._scaled_mm {shape}", lambda: scaled_mm(x, w, flops))  # noqa: B023
        ck.run(f"torch bf16 matmul {shape}", lambda: bf16_matmul(x, n, k, flops))  # noqa: B023
        del w, x

    def grouped(m, n, k):
        w = make_weights("fp8", experts, n, k, dev, gen)
        offs, counts = route(m, experts, dev, torch.Generator().manual_seed(seed))
        x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
        ms = timer.eager(lambda: api.grouped_linear(x, offs, w))
        fields = _gemm_fields(ms, 2 * m * n * k, fp8_peak, f", {sum(c > 0 for c in counts)} experts hit (top-1)")
        return fields

    m, n, k = shapes[-1]
    ck.run(f"Triton fp8 grouped_linear {m} tokens x {n}x{k}, {experts} experts", lambda: grouped(m, n, k))


def demo_cache(ctx: dict) -> Path:
    return Path(ctx["work_dir"]) / "demo"


def section_demo_prep(ck: Check) -> None:
    """The int4 demo's synthetic checkpoint (CPU work), made before the demo runs on the GPU."""

    def prep():
        from scripts.int4_demo import prepare_synthetic

        start = time.perf_counter()
        path = prepare_synthetic(demo_cache(ck.ctx))
        return {"status": "info", "result": f"{path} ready after {time.perf_counter() - start:.0f} s"}

    ck.run("small preset, MP=2, quantized to INT4 by 2 ranks", prep)


def parse_demo(output: str) -> dict:
    """The figures scripts/int4_demo.py prints."""
    import re

    found = {}
    for key, pattern, cast in (
        ("device", r"^device: (\S+)", str), ("load_s", r"load time: ([\d.]+) s", float),
        ("tokens", r"^(\d+) tokens in", int), ("tok_s", r"then ([\d.]+) tokens/s", float),
        ("peak_mib", r"^peak memory: (\d+) MiB", int),
    ):  # fmt: skip
        hit = re.search(pattern, output, re.MULTILINE)
        if hit:
            found[key] = cast(hit.group(1))
    return found


def section_demo(ck: Check, max_gen_len: int = 64) -> None:
    def demo():
        # the demo's default path (on a GPU: its decode step compiled, CUDA graphs), whatever the caller's
        # LLAMA_LITE_COMPILE says
        env = {k: v for k, v in os.environ.items() if k != "LLAMA_LITE_COMPILE"}
        env.update(LLAMA_LITE_CACHE=str(demo_cache(ck.ctx)), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "scripts.int4_demo", "--device", ck.device.type, "--max_gen_len", str(max_gen_len)]
        rc, out, timed_out = run_process(cmd, max(5.0, ck.time_left() - 3), env, ck)
        got = parse_demo(out)
        tail = out.rstrip().splitlines()[-12:]
        detail = {**got, "returncode": rc, "output_tail": tail}
        if timed_out or rc != 0:
            last = next((line for line in reversed(tail) if line.strip()), "")
            why = "timed out" if timed_out else f"exit status {rc}"
            return {"status": "error", "error": one_line(f"{why}: {last}"), "detail": detail}
        ok = str(got.get("device", "")).startswith(ck.device.type) and got.get("tok_s") is not None
        return {"status": "pass" if ok else "fail", "figure": got.get("tok_s"), "unit": "tok/s", "detail": detail,
                "result": f"{got.get('tokens')} tokens on {got.get('device')}, load {got.get('load_s')} s, "
                          f"peak {got.get('peak_mib')} MiB"}  # fmt: skip

    ck.run(f"python -m scripts.int4_demo --device {ck.device.type}", demo)


def section_checkpoint(ck: Check, preset: str = "bench", layers: Optional[int] = 4, threads: int = 8) -> None:
    """The decode sections' synthetic checkpoint (CPU work), written while the kernels are checked."""
    import torch

    from llama_lite.synthetic import checkpoint_bytes, preset_args, write_random_checkpoint

    torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))
    overrides = {"n_layers": layers} if layers else {}
    path = Path(ck.ctx["work_dir"]) / f"decode-{preset}-{layers or 'all'}l"

    def write():
        nbytes = checkpoint_bytes(preset_args(preset, **overrides))
        start = time.perf_counter()
        reused = (path / "params.json").is_file()  # written under a temporary name, renamed when complete
        if not reused:
            write_random_checkpoint(path, preset=preset, overrides=overrides, seed=0)
        s = time.perf_counter() - start
        ck.share(decode_ckpt=str(path))
        how = "reused" if reused else f"written in {s:.0f} s"
        return {"status": "info", "result": f"{preset} preset, {layers or 'all'} layers, {nbytes / 1e9:.2f} GB: {how}"}

    ck.run(f"{preset} preset, {layers or 'all'} layers", write)


def step_bytes(parts: dict, batch: int, experts: int, top_k: int) -> float:
    """Weight bytes one decoding step of ``batch`` rows reads: everything ``bytes_per_token`` counts for
    one token, with the routed experts those rows are expected to hit under uniform top-k routing."""
    routed = parts.get("routed experts", 0)
    hit = 1 - (1 - top_k / experts) ** batch if experts > top_k else 1.0
    return sum(parts.values()) - routed + routed * experts / top_k * hit


def compile_stats() -> dict:
    try:
        from torch._dynamo.utils import counters

        return {"graph_breaks": sum(counters["graph_break"].values()),
                "unique_graphs": counters["stats"]["unique_graphs"],
                **{k: v for k, v in counters["inductor"].items() if "cudagraph" in k}}
    except Exception as err:  # noqa: BLE001 -- diagnostics only
        return {"unavailable": one_line(err, 100)}


def section_decode(ck: Check, mode: str = "none", compile: bool = False, batches=(1, 8), new_tokens: int = 32,
                   warmup_tokens: int = 8, prompt_len: int = 16, runs: int = 2, max_seq_len: int = 256) -> None:  # fmt: skip
    import quantization
    from scripts.benchmark import bytes_per_token, random_prompts, timed_generate

    dev = ck.device

    def build():
        ckpt = ck.ctx.get("decode_ckpt")
        if not ckpt:
            raise RuntimeError("no checkpoint: the decode_checkpoint section did not write one")
        start = time.perf_counter()
        llama = quantization.build(ckpt, mode, max_seq_len=max_seq_len, max_batch_size=max(batches), world_size=1,
                                   compile=compile, device=str(dev), progress=False)  # fmt: skip
        moe = llama.args.moe_args
        experts, top_k = (moe.num_experts, moe.top_k) if moe else (1, 1)
        parts = bytes_per_token(llama.model, top_k)
        compiled = getattr(llama, "compile_seconds", None)  # compiling at load, batch 1 (None: eager)
        where = f" ({compiled:.1f} s of it compiling the decode step)" if compiled else ""
        return {"status": "info", "value": (llama, parts, experts, top_k),
                "detail": {"bytes_per_token": parts, "compile_seconds": compiled, **compile_stats()},
                "result": f"built in {time.perf_counter() - start:.1f} s{where}; a token reads "
                          f"{sum(parts.values()) / 1e9:.3f} GB of weights ({experts} experts, top-{top_k})"}  # fmt: skip

    built = ck.run("build", build)
    if built is None:
        return
    llama, parts, experts, top_k = built
    bw = ck.ctx.get("hbm_gbps")
    if not bw:  # the env section did not run: measure here
        bw = copy_bandwidth(dev, GiB if dev.type == "cuda" else 2**26, make_timer(dev))

    def decode(b: int) -> dict:
        start = time.perf_counter()
        timed_generate(llama, random_prompts(b, prompt_len, 100 + b), warmup_tokens)  # batch > 1 compiles again
        warm = time.perf_counter() - start
        rates, last = [], 0.0
        for r in range(runs):
            if r and ck.time_left() < 2 * last:  # the first run always; more while time allows
                break
            t, stamps = timed_generate(llama, random_prompts(b, prompt_len, 200 + 10 * b + r), new_tokens)
            last = stamps[-1] - t
            rates.append(b * (len(stamps) - 1) / (stamps[-1] - stamps[0]))
        tok_s = statistics.median(rates)
        step = step_bytes(parts, b, experts, top_k)
        roof = b * bw * 1e9 / step
        return {"status": "info", "figure": tok_s, "unit": "tok/s", "pct": 100 * tok_s / roof,
                "pct_of": f"roofline {roof:.0f} tok/s ({step / 1e9:.3g} GB a step at {bw:.0f} GB/s)",
                "detail": {"runs": rates, "warmup_s": warm, "step_bytes": step, "bandwidth_gbps": bw, **compile_stats()},
                "result": f"{new_tokens} new tokens, median of {len(rates)}, after a warm-up of {warm:.1f} s"}  # fmt: skip

    for b in batches:
        ck.run(f"batch {b}", lambda b=b: decode(b))

    def greedy():
        tokens = llama.generate_tokens(random_prompts(1, prompt_len, 7), temperature=0, max_gen_len=16, stop_tokens=[])[0]
        key = f"greedy_{mode}"
        if not compile:
            ck.share(**{key: tokens})
            return {"status": "info", "result": "16 greedy tokens kept for the compiled run to compare"}
        eager = ck.ctx.get(key)
        if eager is None:
            return {"status": "skipped", "result": "no eager run to compare with"}
        first = next((i for i, (a, e) in enumerate(zip(tokens, eager)) if a != e), None)
        return {"status": "info", "detail": {"tokens": tokens, "eager": eager},
                "result": "the same 16 greedy tokens as eager" if first is None else
                f"greedy tokens differ from eager's from step {first} (fused ops may round bf16 differently)"}  # fmt: skip

    ck.run("greedy tokens (compiled vs eager)", greedy)


# ----------------------------------------------------------------------------------------------
# the command


def all_sections(decode_layers: int = 4) -> list[Section]:
    m = "scripts.gpu_check:"
    decode = [
        (f"decode_{name}_{kind}", dict(mode=mode, compile=kind == "compiled"), 60 if kind == "eager" else 150)
        for kind in ("eager", "compiled") for name, mode in (("bf16", "none"), ("int4", "int4_mixed"))
    ]  # fmt: skip
    return [
        Section("env", "versions, GPU, HBM copy bandwidth", m + "section_env", cap_s=60, min_s=15),
        Section("decode_checkpoint", "the decode model's synthetic checkpoint (background)", m + "section_checkpoint",
                dict(layers=decode_layers), cap_s=300, background=True),
        Section("demo_checkpoint", "the int4 demo's synthetic checkpoint (background)", m + "section_demo_prep",
                cap_s=300, background=True),
        Section("kernels", "Triton kernels (compiled) vs kernels.reference", m + "section_kernels", cap_s=150, min_s=30),
        Section("fp8_gemm", "fp8 prefill GEMM vs the fp8 peak", m + "section_fp8_gemm", cap_s=60, min_s=20),
        Section("int4_demo", "python -m scripts.int4_demo on the GPU", m + "section_demo", cap_s=120, min_s=40,
                after=("demo_checkpoint",)),
        *[Section(name, f"decode tok/s, {kw['mode']}, compile={kw['compile']}", m + "section_decode", kw, cap_s=cap,
                  min_s=30, after=("decode_checkpoint",)) for name, kw, cap in decode],
    ]  # fmt: skip


def select(sections: list[Section], names) -> list[Section]:
    """The sections ``names`` asks for (``decode``: all decode ones), with the background ones they need."""
    from scripts.common import FlagError

    if names is None:
        return sections
    wanted = {n.strip() for n in (names.split(",") if isinstance(names, str) else names) if str(n).strip()}
    known = {s.name for s in sections} | {"decode"}
    unknown = sorted(wanted - known)
    if unknown or not wanted:
        raise FlagError(f"unknown --sections {', '.join(unknown) or names!r}; choose from {', '.join(sorted(known))}")
    keep = {s.name for s in sections if s.name in wanted or ("decode" in wanted and s.name.startswith("decode_"))}
    keep |= {dep for s in sections if s.name in keep for dep in s.after}
    return [s for s in sections if s.name in keep]


def gpu_check(out: str = "gpu_check.json", budget_s: float = 450.0, fp8_peak_tflops: Optional[float] = None,
              sections: Optional[str] = None, work_dir: Optional[str] = None, decode_layers: int = 4) -> None:  # fmt: skip
    """Check everything that needs CUDA on this GPU; a markdown table on stdout, the JSON in ``out``.

    Args:
        out: the JSON report, rewritten after every item.
        budget_s: total time; sections still to run share what is left, each keeping its minimum.
        fp8_peak_tflops: the fp8 dense peak to compare with (default: the GPU's datasheet, if known).
        sections: comma-separated subset of env, kernels, fp8_gemm, int4_demo, decode (default: all).
        work_dir: where the synthetic checkpoints go (default: ~/.cache/llama-lite/gpu_check).
        decode_layers: layers of the bench preset the decode model keeps.
    """
    import torch

    from llama_lite.errors import LlamaLiteError
    from scripts.common import FlagError

    def positive(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0

    if not positive(budget_s):
        raise FlagError(f"--budget_s must be a number of seconds > 0, got {budget_s!r}")
    if fp8_peak_tflops is not None and not positive(fp8_peak_tflops):
        raise FlagError(f"--fp8_peak_tflops must be a number > 0, got {fp8_peak_tflops!r}")
    if isinstance(decode_layers, bool) or not isinstance(decode_layers, int) or decode_layers < 1:
        raise FlagError(f"--decode_layers must be a positive integer, got {decode_layers!r}")
    chosen = select(all_sections(decode_layers), sections)
    if not torch.cuda.is_available():
        raise LlamaLiteError(f"gpu_check needs a CUDA GPU, and torch {torch.__version__} sees none "
                             "(torch.cuda.is_available() is False); nothing was run")  # fmt: skip
    work = Path(work_dir).expanduser() if work_dir else Path.home() / ".cache" / "llama-lite" / "gpu_check"
    work.mkdir(parents=True, exist_ok=True)
    ctx = {"device": "cuda", "work_dir": str(work), "fp8_peak_tflops": fp8_peak_tflops,
           "caller_triton_interpret": os.environ.get("TRITON_INTERPRET")}  # fmt: skip
    status = execute(chosen, out, float(budget_s), ctx)
    if status:
        raise SystemExit(status)


def execute(sections: list[Section], out, budget_s: float, ctx: dict) -> int:
    """Run ``sections``, print the table on stdout; 0 when no item failed or raised, else 1."""
    log(f"{len(sections)} sections, budget {budget_s:.0f} s, report in {out}")
    report = Runner(sections, out, budget_s, ctx).run()
    print(report["markdown"], flush=True)
    log(f"wrote {out}")
    bad = report["summary"].get("fail", 0) + report["summary"].get("error", 0)
    return 1 if bad or report["interrupted"] else 0


def main() -> None:
    if sys.argv[1:2] == [WORKER_COMMAND]:
        sys.exit(worker_main(sys.argv[2]))
    missing = [name for name in NEEDED_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:  # before anything imports them: one line, not a traceback
        print(f"error: gpu_check needs the Python package(s) {', '.join(missing)}, which are not installed here "
              "(pip install -e . installs them)", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    from scripts.common import run_cli

    run_cli(gpu_check)


if __name__ == "__main__":
    # The worker resolves sections as scripts.gpu_check: run that one copy of the module, not __main__
    # beside it (two copies would have two DeviceLost classes, two clocks).
    from scripts.gpu_check import main as _main

    _main()
