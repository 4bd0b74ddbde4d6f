"""transformers' ``fbgemm_fp8`` folders (Meta's own FP8 Llama 4 Maverick) as llama-lite fp8 weights.

``quantization_config: {quant_method: fbgemm_fp8, activation_scale_ub, modules_to_not_convert}``.
Every Linear (and the fused experts) not named in ``modules_to_not_convert`` is stored as
float8_e4m3fn with fp32 scales per output channel; activations are quantized per token at run
time with their scale bounded by ``activation_scale_ub``: the numbers of llama-lite's fp8 rowwise
format. Fused experts: ``experts.gate_up_proj`` [E, D, 2F] with ``gate_up_proj_scale`` [E, 1, 2F],
``experts.down_proj`` [E, F, D] with ``down_proj_scale`` [E, D, 1].
"""

import re

import torch

from kernels.formats import Fp8Weight
from llama_lite.errors import CheckpointError

from ..modes import QuantizationMode
from .hf import _ROUTER_RULE, HFQuantizedSource, llama_name

_FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.feed_forward\.experts$")


def excluded(name: str, patterns: list) -> bool:
    """transformers' rule for modules_to_not_convert: a pattern matches from the start up to a module
    boundary (as a regex), or is a suffix of the name."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns)


class FbgemmFp8Source(HFQuantizedSource):
    label = "fbgemm_fp8"

    def scan(self) -> None:
        ub = self.qcfg.get("activation_scale_ub", 1200.0)
        if not isinstance(ub, (int, float)) or isinstance(ub, bool) or ub <= 0:
            raise CheckpointError(f"{self.dir}: activation_scale_ub in quantization_config must be a positive number, got {ub!r}")
        self.ub = float(ub)
        skip = self.qcfg.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(p, str) for p in skip):
            raise CheckpointError(f"{self.dir}: modules_to_not_convert in quantization_config must be a list of names")
        for module, params in self.modules.items():
            stored = params[next(iter(params))].rsplit(".", 1)[0]
            convert = not (excluded(stored, skip) or excluded(module, skip))
            fused = _FUSED_EXPERTS.match(module)
            if fused:
                quantized = self._dtype(f"{module}.gate_up_proj") == "F8_E4M3"
                self._agree(module, convert, quantized, ("gate_up_proj_scale", "down_proj_scale"))
                if quantized:
                    for w in ("w1", "w3", "w2"):
                        name = f"layers.{fused[1]}.feed_forward.experts.{w}"
                        self.sources[name] = [(module, None)]
                        self.quantized.add(name)
                continue
            mapped = llama_name(module)
            if mapped is None and not _ROUTER_RULE.match(module):
                continue
            quantized = self.stored_quantized(module)
            if _ROUTER_RULE.match(module) and convert:
                raise CheckpointError(
                    f"{self.dir}: modules_to_not_convert leaves the router {module} to fp8; llama-lite keeps routers in bf16"
                )
            self._agree(module, convert, quantized, ("weight_scale",))
            if quantized:
                if mapped[1] is not None:
                    raise CheckpointError(f"{self.dir} stores experts one per module ({module}); fbgemm_fp8 fuses them")
                self.quantized.add(mapped[0])
        if not self.quantized:
            raise CheckpointError(f"{self.dir}: its fbgemm_fp8 quantization_config converts none of the model's linear layers")

    def _dtype(self, name: str) -> str:
        if name not in self.raw:
            raise CheckpointError(f"{self.dir} lacks the tensor {name}")
        handle, stored = self.raw[name]
        return handle.get_slice(stored).get_dtype()

    def _agree(self, module: str, convert: bool, quantized: bool, scales: tuple) -> None:
        if quantized and not convert:
            raise CheckpointError(f"{self.dir} stores {module} in fp8 although modules_to_not_convert names it")
        if convert and not quantized:
            raise CheckpointError(
                f"{self.dir} lacks {module}.{scales[0]} (it stores {module} unquantized, yet modules_to_not_convert "
                "does not name it)"
            )
        for s in scales if quantized else ():
            if f"{module}.{s}" not in self.raw:
                raise CheckpointError(f"{self.dir} lacks {module}.{s}")

    def detect_mode(self) -> QuantizationMode:
        return QuantizationMode.fp8_mixed

    def module_weight(self, name: str, module: str) -> Fp8Weight:
        def fp8(t: torch.Tensor, what: str) -> torch.Tensor:
            if t.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"{module}.{what} is {t.dtype}, not float8_e4m3fn")
            return t

        def check(scale: torch.Tensor, want: tuple, what: str) -> torch.Tensor:
            if tuple(scale.shape) != want:
                raise CheckpointError(f"{module}.{what} has shape {tuple(scale.shape)}; fbgemm_fp8 needs {want}")
            return scale.float()

        which = name.rsplit(".", 1)[-1]
        if which in ("w1", "w3"):
            gate_up = fp8(self.tensor(f"{module}.gate_up_proj"), "gate_up_proj")  # [E, D, 2F]
            e, _, f2 = gate_up.shape
            scale = check(self.tensor(f"{module}.gate_up_proj_scale"), (e, 1, f2), "gate_up_proj_scale")
            half = slice(0, f2 // 2) if which == "w1" else slice(f2 // 2, f2)
            w = gate_up[:, :, half].transpose(1, 2).contiguous()  # [E, F, D]
            return Fp8Weight(weight=w, scale=scale[:, 0, half].contiguous(), activation_scale_ub=self.ub)
        if which == "w2":
            down = fp8(self.tensor(f"{module}.down_proj"), "down_proj")  # [E, F, D]
            e, _, d = down.shape
            scale = check(self.tensor(f"{module}.down_proj_scale"), (e, d, 1), "down_proj_scale")
            return Fp8Weight(weight=down.transpose(1, 2).contiguous(), scale=scale[:, :, 0].contiguous(),
                             activation_scale_ub=self.ub)
        weight = fp8(self.tensor(f"{module}.weight"), "weight")
        scale = check(self.tensor(f"{module}.weight_scale"), (weight.shape[0], 1), "weight_scale")
        return Fp8Weight(weight=weight, scale=scale[:, 0].contiguous(), activation_scale_ub=self.ub)
