"""scripts/bench_kernels.py --quick: runs in seconds and reports every format and path."""

import json

from kernels import cpu
from scripts import bench_kernels


def test_bench_quick(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench_kernels.main(quick=True, json=str(out), reps=1)
    data = json.loads(out.read_text())
    rows = [r for r in data["rows"] if r["case"] not in ("attention", "prefill_attention")]
    assert {r["format"] for r in rows} == set(bench_kernels.FORMATS)
    assert {r["path"] for r in rows} == {"cpu", "reference", "int4pack"}
    att = [r for r in data["rows"] if r["case"] == "attention"]
    assert {(r["batch"], r["path"]) for r in att} == {(n, p) for n in (16, 100) for p in ("cpu", "sdpa")}
    assert all(r["ms"] > 0 and r["vs_reference"] > 0 for r in att)
    pre = [r for r in data["rows"] if r["case"] == "prefill_attention"]
    kernel = ["cpu"] if cpu.isa() == "avx512" else []  # the only cap the prefill kernel runs under
    assert sorted(r["path"] for r in pre) == sorted(["sdpa", *kernel]) and all(r["batch"] == 40 for r in pre)
    assert all(r["ms"] > 0 and r["vs_reference"] > 0 for r in pre)
    assert all(r["ms"] > 0 and r["gbs"] > 0 for r in rows)
    cpu_int4 = [r for r in rows if r["format"] == "int4" and r["path"] == "cpu"]
    assert cpu_int4 and all(r["vs_reference"] is not None and r["vs_bf16"] is not None for r in cpu_int4)
    assert "| case | format | batch | path |" in capsys.readouterr().out
