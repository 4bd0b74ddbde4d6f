"""scripts/gpu_check.py: the whole check on a CUDA GPU (skipped without one); everywhere, its machinery
(time budget, JSON rewritten as it goes, errors caught per item and per section, workers killed at their
time or started again after a crash) and its sections' code on the CPU paths."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scripts import gpu_check as G
from scripts.common import FlagError

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "workers" / "gpu_check_fakes.py"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the full check needs a CUDA GPU")
def test_full_check_on_the_gpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "-m", "scripts.gpu_check", "--out", str(out), "--work_dir", str(tmp_path / "work")]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    assert report["finished"] and "| section | item |" in r.stdout
    assert [s["name"] for s in report["sections"]] == [s.name for s in G.all_sections()]
    assert r.returncode == 0, report["markdown"]


def test_without_cuda_it_says_so_in_one_line_and_exits_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: gpu_check needs a CUDA GPU")
    assert not out.exists()  # nothing was run, nothing written


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget_s=0), "--budget_s"), (dict(fp8_peak_tflops=-1.0), "--fp8_peak_tflops"),
    (dict(sections="env,bogus"), "bogus"), (dict(decode_layers=0), "--decode_layers"),
])  # fmt: skip
def test_bad_flags_are_refused_before_anything_runs(kwargs, match):
    with pytest.raises(FlagError, match=match):
        G.gpu_check(**kwargs)


def test_sections_bring_the_background_work_they_need():
    names = lambda picked: [s.name for s in G.select(G.all_sections(), picked)]  # noqa: E731
    assert names("env,kernels") == ["env", "kernels"]
    assert names("int4_demo") == ["demo_checkpoint", "int4_demo"]
    assert names("decode") == ["decode_checkpoint"] + [f"decode_{m}_{k}" for k in ("eager", "compiled")
                                                       for m in ("bf16", "int4")]  # fmt: skip


def test_runner_records_errors_and_the_budget_and_writes_the_json_as_it_goes(tmp_path, capsys):
    out = tmp_path / "report.json"

    def raising(ck):
        ck.run("boom", lambda: 1 / 0)
        ck.run("after boom", lambda: {"result": "still ran", "figure": 2.0, "unit": "x", "pct": 50.0, "pct_of": "peak"})

    def reader(ck):  # what the file holds while the run goes on
        ck.run("json on disk", lambda: {"status": "info", "detail": json.loads(out.read_text())["sections"][0]})

    def broken(ck):
        raise ValueError("a bug outside any item")

    def slow(ck):
        ck.run("sleeps past the budget", lambda: time.sleep(1.2))
        ck.run("not reached", lambda: None)

    sections = [G.Section(name, name, fn, min_s=0.1) for name, fn in (
        ("raising", raising), ("reader", reader), ("broken", broken), ("slow", slow),
        ("late", lambda ck: ck.run("never", lambda: None)),
    )]  # fmt: skip
    assert G.execute(sections, out, budget_s=1.0, ctx={}) == 1  # errors: status 1

    report = json.loads(out.read_text())
    assert report["finished"] and not report["interrupted"]
    recs = {s["name"]: s for s in report["sections"]}
    boom, after = recs["raising"]["rows"]
    assert boom["status"] == "error" and boom["error"] == "ZeroDivisionError: division by zero"
    assert "ZeroDivisionError" in boom["traceback"][-1] and after["status"] == "pass"
    seen = recs["reader"]["rows"][0]["detail"]  # the first section, as written before the second began
    assert seen["status"] == "error" and [r["item"] for r in seen["rows"]] == ["boom", "after boom"]
    assert recs["broken"]["status"] == "error" and recs["broken"]["error"] == "ValueError: a bug outside any item"
    ran, skipped = recs["slow"]["rows"]
    assert ran["status"] == "pass" and skipped["status"] == "skipped" and "not reached" in skipped["result"]
    assert recs["late"]["status"] == "skipped" and "budget" in recs["late"]["rows"][0]["result"]
    assert report["summary"] == {"pass": 2, "fail": 0, "error": 2, "skipped": 2, "info": 1}

    table = capsys.readouterr().out
    assert table == report["markdown"] + "\n"
    assert "| raising | boom | ZeroDivisionError: division by zero |  |  | error |" in table
    assert "| raising | after boom | still ran | 2 x | 50.0% of peak | pass |" in table
    assert "| broken | (section) | ValueError: a bug outside any item |" in table


def test_workers_are_killed_at_their_time_and_started_again_after_a_crash(tmp_path):
    out = tmp_path / "report.json"
    sections = [G.Section("hangs", "hangs", f"{FAKES}:hangs", cap_s=2, min_s=0.1),
                G.Section("dies", "dies", f"{FAKES}:dies", cap_s=30, min_s=0.1)]  # fmt: skip
    report = G.Runner(sections, out, 60, {}).run()
    hangs, dies = report["sections"]
    assert hangs["status"] == "timeout"
    assert [(r["item"], r["status"]) for r in hangs["rows"]] == [("quick", "pass"), ("hangs", "error")]
    assert "time limit" in hangs["rows"][1]["error"]
    assert [(r["item"], r["status"]) for r in dies["rows"]] == [("before", "pass"), ("dies", "error"), ("after", "pass")]
    assert "exit status 7" in dies["rows"][1]["error"] and dies["attempts"] == 2  # the second skipped what was done
    assert dies["rows"][2]["result"] == "ctx seen: True"  # a value shared by one worker reaches the next
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))


def test_a_worker_whose_runner_is_gone_or_late_ends_itself(tmp_path):
    spec = tmp_path / "spec.json"
    events = tmp_path / "events"
    spec.write_text(json.dumps({"section": "hangs", "target": f"{FAKES}:hangs", "kwargs": {}, "ctx": {},
                                "deadline": time.time() + 60, "done": [], "events": str(events), "t0": time.time(),
                                "parent": os.getpid(), "hard_deadline": time.time() + 1}))  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "scripts.gpu_check", G.WORKER_COMMAND, str(spec)], cwd=ROOT,
                          capture_output=True, timeout=30, start_new_session=True)  # fmt: skip
    assert proc.returncode == -9  # killed by its watchdog, not by the 120 s sleep ending
    assert '"item": "quick"' in events.read_text()


def test_compare_passes_bf16_rounding_and_catches_a_wrong_element():
    want = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    tol = G.TOLERANCES["linear"]
    assert G.compare(want.bfloat16(), want, *tol)["ok"]
    bad = want.clone()
    bad[3, 4] += 0.1 * want.abs().max()
    c = G.compare(bad, want, *tol)
    assert not c["ok"] and c["max_err_of_max_ref"] == pytest.approx(0.1, rel=1e-3)
    bad[3, 4] = float("nan")
    assert not G.compare(bad, want, *tol)["ok"]
    assert not G.compare(torch.zeros(2, 2), torch.zeros(2, 2), *tol)["ok"]  # an all-zero reference proves nothing


def test_figures_of_the_datasheets_and_of_the_roofline():
    assert G.peak_tflops({"gpu_name": "NVIDIA H200"}, "fp8")[0] == 1979
    assert G.peak_tflops({"gpu_name": "NVIDIA H200"}, "bf16")[0] == 989.5
    assert G.peak_tflops({"gpu_name": "NVIDIA H200 NVL"}, "fp8")[0] == 1670.5
    assert G.datasheet("NVIDIA GH200 480GB")["key"] == "GH200"
    assert G.peak_tflops({"gpu_name": "NVIDIA H100 80GB HBM3", "fp8_peak_tflops": 1500}, "fp8") == (1500.0, "--fp8_peak_tflops")
    assert G.peak_tflops({"gpu_name": "NVIDIA A100-SXM4-80GB"}, "fp8")[0] is None
    parts = {"attention": 100, "routed experts": 10, "output": 50}  # 8 experts, top-1: 80 in all
    assert G.step_bytes(parts, 1, 8, 1) == 160
    assert G.step_bytes(parts, 8, 8, 1) == pytest.approx(150 + 80 * (1 - (7 / 8) ** 8))
    assert G.expert_offsets(1, 4) == [0, 1, 1, 1, 1] and G.expert_offsets(33, 4) == [0, 17, 17, 25, 33]


def test_the_demo_output_is_read():
    text = ("checkpoint: /c/small-mp2-int4\ndevice: cuda:0   load time: 4.2 s\nweights: 214 MiB in INT4 mode\n\n"
            "user> hi\nassistant> text\n\n64 tokens in 1.50 s: first token after 0.30 s, then 52.5 tokens/s\n"
            "peak memory: 731 MiB (GPU allocated)\n")  # fmt: skip
    assert G.parse_demo(text) == {"device": "cuda:0", "load_s": 4.2, "tokens": 64, "tok_s": 52.5, "peak_mib": 731}


# --- the sections themselves, on the CPU paths (the GPU ones run in the full check) ------------------


def run_section(fn, ctx: dict, **kwargs):
    events = []
    ck = G.Check("t", {"device": "cpu", **ctx}, time.time() + 300, events.append)
    fn(ck, **kwargs)
    return {e["row"]["item"]: e["row"] for e in events if "row" in e}, ck.ctx


@pytest.fixture
def kernels_backend():
    from kernels import dispatch

    before = dispatch.get_backend()
    yield
    dispatch.set_backend(before)


def test_env_section_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as in a worker (tests/kernels sets it in this process)
    rows, ctx = run_section(G.section_env, {"caller_triton_interpret": "1"}, copy_bytes=2**22, reps=2)
    assert rows["GPU"]["status"] == "skipped"
    assert rows["HBM copy bandwidth (read + write)"]["figure"] > 0 and ctx["hbm_gbps"] > 0
    assert all(r["status"] in ("info", "skipped") for r in rows.values()), rows
    assert "the caller's environment had TRITON_INTERPRET=1" in rows["TRITON_INTERPRET"]["result"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # were the kernels interpreted, the check would say so
    rows, _ = run_section(G.section_env, {}, copy_bytes=2**22, reps=1)
    assert rows["TRITON_INTERPRET"]["status"] == "fail"


def test_kernel_section_on_the_cpu_kernels(kernels_backend):
    from scripts.bench_triton import FORMATS

    rows, _ = run_section(G.section_kernels, {}, impl="cpu", ms=(1, 5, 33), dim=128, hidden=128)
    assert set(rows) == {f"{op} {fmt}" for fmt in FORMATS for op in G.KERNEL_OPS}
    bad = {item: r.get("error") or r["result"] for item, r in rows.items() if r["status"] != "pass"}
    assert not bad


def test_fp8_gemm_section_on_the_cpu_kernels(kernels_backend):
    rows, ctx = run_section(G.section_fp8_gemm, {"gpu_name": "NVIDIA H200"}, impl="cpu", shapes=((16, 64, 256),),
                            experts=4, reps=1)  # fmt: skip
    assert rows["Triton fp8 linear 16x64x256"]["status"] == "pass"  # and equal to the reference
    assert all(r["figure"] > 0 and r["pct"] > 0 for r in rows.values()), rows
    assert "1979 TFLOP/s" in rows["torch._scaled_mm 16x64x256"]["pct_of"] and ctx["fp8_peak"][0] == 1979


def test_decode_section_on_cpu(tiny_ckpt, tmp_path):
    (tmp_path / "decode-tiny-alll").symlink_to(tiny_ckpt)  # section_checkpoint finds it written
    rows, ctx = run_section(G.section_checkpoint, {"work_dir": str(tmp_path)}, preset="tiny", layers=None)
    assert "reused" in rows["tiny preset, all layers"]["result"]
    # A given bandwidth, far above any CPU's, so that the roofline's share stays below 100% however fast
    # the tiny model (in cache) runs; the share must still be the one the step's bytes give.
    bw = 1e5
    rows, ctx = run_section(G.section_decode, {**ctx, "hbm_gbps": bw}, mode="int4_mixed", batches=(1, 2),
                            new_tokens=4, warmup_tokens=2, runs=1, max_seq_len=64)  # fmt: skip
    assert rows["build"]["status"] == "info" and rows["build"]["detail"]["bytes_per_token"]["routed experts"] > 0
    for b in (1, 2):
        r = rows[f"batch {b}"]
        assert r["status"] == "info" and r["figure"] > 0 and 0 < r["pct"] < 100, r
        roof = b * bw * 1e9 / r["detail"]["step_bytes"]
        assert r["pct"] == pytest.approx(100 * r["figure"] / roof) and r["detail"]["bandwidth_gbps"] == bw, r
    assert len(ctx["greedy_int4_mixed"]) == 16  # for the compiled run to compare with
