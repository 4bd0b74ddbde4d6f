"""scripts.quant_error's core on a synthetic layer, so the script cannot rot unnoticed."""

import math

import torch

from scripts.quant_error import FORMATS, layer_errors, markdown_table, summarize


def test_layer_errors_on_synthetic_layer():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g) * 0.03
    x = torch.randn(40, 256, generator=g)
    r = layer_errors(w, x)
    assert set(r) == set(FORMATS)
    for fmt, m in r.items():
        assert math.isfinite(m["weight_sqnr_db"]) and 0 < m["output_rel_err"] < 0.5, fmt
    # sanity of the ordering: 8-bit beats 4-bit, and weights-only beats w+a for nvfp4
    assert r["fp8 rowwise (w8a8, per-token acts)"]["weight_sqnr_db"] > r["int4 g128 (w4a16)"]["weight_sqnr_db"] + 6
    assert r["nvfp4 weights-only"]["output_rel_err"] < r["nvfp4 w+a"]["output_rel_err"]
    table = markdown_table(summarize({"layer0": r, "layer1": r}), 2)
    assert table.count("\n") == len(FORMATS) + 1 and "w4a8 naive fp8 cast" in table
