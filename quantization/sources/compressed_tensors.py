"""compressed-tensors folders (what llm-compressor writes and vLLM serves) as llama-lite weights.

``quantization_config`` names config groups (``targets``, ``weights``, ``input_activations``,
``format``) and an ``ignore`` list; each quantized Linear stores, by format:

- ``pack-quantized``: ``weight_packed`` int32 (eight 4-bit values per word, each offset by 8),
  ``weight_scale`` [N, K/group], ``weight_shape``;
- ``int-quantized``: ``weight`` int8 holding the values, ``weight_scale``;
- ``float-quantized``: ``weight`` float8_e4m3fn, ``weight_scale`` [N, 1] (or one per tensor);
- ``nvfp4-pack-quantized``: ``weight_packed`` uint8 (two e2m1 per byte), ``weight_scale`` e4m3
  per 16, ``weight_global_scale`` fp32, ``input_global_scale`` when activations are nvfp4 too.

Schemes map onto llama-lite's formats with the same numbers: int4 symmetric group (or channel)
weights -> int4; with dynamic per-token fp8 activations -> w4a8 (fp8 group scales and fp32
channel scales derived from the bf16 group scales); fp8 channel (or tensor) weights with dynamic
per-token fp8 activations -> fp8 rowwise; nvfp4 -> nvfp4. compressed-tensors' per-token fp8
activations have no scale bound, so none is applied. Anything else is an error naming the module.
"""

import re
from collections import Counter
from typing import Optional

import torch

from kernels.formats import Fp8Weight, Int4Weight, NVFP4Weight, pack_int4
from llama_lite.errors import CheckpointError

from ..formats import w4a8_from_int4
from ..modes import QuantizationMode
from .hf import _ROUTER_RULE, HFQuantizedSource, llama_name

FORMAT_MODES = {
    "int4": QuantizationMode.int4_mixed,
    "w4a8": QuantizationMode.w4a8,
    "fp8": QuantizationMode.fp8_mixed,
    "nvfp4": QuantizationMode.nvfp4,
}
# compressed-tensors' dynamic per-token activations are not bounded: no upper bound on the scale.
NO_SCALE_BOUND = float("inf")
_NEEDS = {  # stored tensors per llama-lite format and compressed-tensors format
    ("int4", "pack-quantized"): ("weight_packed", "weight_scale", "weight_shape"),
    ("int4", "int-quantized"): ("weight", "weight_scale"),
    ("fp8", "float-quantized"): ("weight", "weight_scale"),
    ("nvfp4", "nvfp4-pack-quantized"): ("weight_packed", "weight_scale", "weight_global_scale"),
}


def _args_summary(a: Optional[dict]) -> str:
    if not a:
        return "none"
    strategy = a.get("strategy") or ("group" if a.get("group_size") else "tensor")
    text = f"{a.get('type', 'int')}{a.get('num_bits', 8)} {strategy}"
    if strategy in ("group", "tensor_group") and a.get("group_size"):
        text += f" {a['group_size']}"
    if strategy == "block" and a.get("block_structure"):
        text += f" {a['block_structure']}"
    if not a.get("symmetric", True):
        text += " asymmetric"
    if a.get("dynamic"):
        text += f" dynamic{'' if a['dynamic'] is True else ' ' + str(a['dynamic'])}"
    return text


def _is(a: Optional[dict], type_: str, bits: int, strategy: str, dynamic, group_size=None) -> bool:
    return (
        isinstance(a, dict) and a.get("type") == type_ and a.get("num_bits") == bits
        and a.get("strategy") == strategy and a.get("symmetric", True) and a.get("dynamic") == dynamic
        and (group_size is None or a.get("group_size") == group_size)
    )


class CompressedTensorsSource(HFQuantizedSource):
    label = "compressed-tensors"

    def scan(self) -> None:
        q = self.qcfg
        groups = q.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise CheckpointError(f"{self.dir}: the compressed-tensors quantization_config has no config_groups")
        for key in ("kv_cache_scheme",):
            if q.get(key):
                raise CheckpointError(f"{self.dir} uses a compressed-tensors {key}, which llama-lite cannot run")
        if q.get("transform_config"):
            raise CheckpointError(f"{self.dir} uses compressed-tensors transforms, which llama-lite cannot run")
        self.groups = groups
        self.ignore = list(q.get("ignore") or [])
        self.default_format = q.get("format")
        self.specs: dict[str, tuple[str, str, dict, str]] = {}  # module -> (group, format, weight args, ct format)
        for module, params in self.modules.items():
            mapped = llama_name(module)
            fixed = _ROUTER_RULE.match(module) or module == "model.embed_tokens"
            if mapped is None and not fixed:
                continue
            param = next(iter(params))
            stored = params[param].rsplit(".", 1)[0]
            group = self._group_of(stored, module, "Embedding" if module == "model.embed_tokens" else "Linear")
            quantized = self.stored_quantized(module)
            if group is None:
                if quantized:
                    raise CheckpointError(
                        f"{self.dir} stores {module} quantized, but its quantization_config (targets and ignore) leaves it out"
                    )
                continue
            if fixed:
                raise CheckpointError(
                    f"{self.dir}: config group {group!r} quantizes {module}; llama-lite keeps routers and embeddings in bf16"
                )
            fmt = self._format_of(group, module)
            ct_format = self.groups[group].get("format") or self.default_format
            if not quantized:
                raise CheckpointError(
                    f"{self.dir} lacks {module}.weight_scale although config group {group!r} quantizes that module"
                )
            ct_format = self._stored_format(module, ct_format)
            needs = _NEEDS.get(("int4" if fmt == "w4a8" else fmt, ct_format))
            if needs is None:
                raise CheckpointError(
                    f"{module} is stored as {ct_format} but config group {group!r} "
                    f"({_args_summary(self.groups[group].get('weights'))}) needs another format"
                )
            for p in needs:
                if p not in params:
                    raise CheckpointError(f"{self.dir} lacks {module}.{p}, which the {ct_format} format needs")
            if fmt == "nvfp4" and self.groups[group].get("input_activations") and "input_global_scale" not in params:
                raise CheckpointError(f"{self.dir} lacks {module}.input_global_scale, which nvfp4 activations need")
            self.specs[module] = (group, fmt, self.groups[group]["weights"], ct_format)
            self.quantized.add(mapped[0])
        for name, entries in self.sources.items():
            kinds = {m in self.specs for m, _ in entries}
            if len(kinds) > 1:
                raise CheckpointError(f"{self.dir} quantizes some of the experts of {name} but not all of them")
        if not self.specs:
            raise CheckpointError(f"{self.dir}: its quantization_config covers none of the model's linear layers")

    # --- matching: compressed-tensors' rules (exact name > "re:" pattern > class name) -------
    def _group_of(self, stored: str, module: str, cls: str) -> Optional[str]:
        if any(self._match(t, stored, module, cls) for t in self.ignore):
            return None
        best, best_rank = None, 0
        for gname, g in self.groups.items():
            targets = g.get("targets") or []
            for t in targets:
                rank = self._match(t, stored, module, cls)
                if rank > best_rank:
                    best, best_rank = gname, rank
        return best

    @staticmethod
    def _match(target: str, stored: str, module: str, cls: str) -> int:
        if target.startswith("re:"):
            pattern = target[3:]
            return 2 if re.match(pattern, stored) or re.match(pattern, module) else 0
        if target in (stored, module):
            return 3
        return 1 if target == cls else 0

    def _format_of(self, group: str, module: str) -> str:
        g = self.groups[group]
        w, act = g.get("weights"), g.get("input_activations")
        scheme = f"config group {group!r} (weights {_args_summary(w)}, activations {_args_summary(act)})"

        def refuse(why: str):
            raise CheckpointError(f"{module} uses {scheme}, which llama-lite cannot run: {why}")

        if not w:
            refuse("it quantizes activations only")
        if g.get("output_activations"):
            refuse("output activation quantization is not supported")
        if w.get("dynamic"):
            refuse("weights with dynamic scales are not supported")
        if w.get("type") == "int" and w.get("num_bits") == 4:
            if not w.get("symmetric", True):
                refuse("asymmetric int4 weights (with zero points) have no kernel here")
            if w.get("strategy") not in ("group", "channel"):
                refuse("int4 weights need group or channel scales")
            if act is None:
                return "int4"
            if _is(act, "float", 8, "token", True):
                return "w4a8"
            refuse("int4 weights run with bf16 or dynamic per-token fp8 activations only")
        if w.get("type") == "float" and w.get("num_bits") == 8:
            if w.get("strategy") not in ("channel", "tensor"):
                refuse("fp8 weights map onto llama-lite's fp8 rowwise format only with channel or tensor scales")
            if _is(act, "float", 8, "token", True):
                return "fp8"
            refuse("fp8 weights run with dynamic per-token fp8 activations only")
        if w.get("type") == "float" and w.get("num_bits") == 4:
            if not _is(w, "float", 4, "tensor_group", False, 16):
                refuse("fp4 weights must be nvfp4 (tensor_group, group 16)")
            if act is None or _is(act, "float", 4, "tensor_group", "local", 16):
                return "nvfp4"
            refuse("nvfp4 weights run with bf16 or nvfp4 activations only")
        refuse("llama-lite runs int4, fp8 and nvfp4 weights")

    def _stored_format(self, module: str, declared: Optional[str]) -> str:
        params = self.modules[module]
        if "weight_packed" in params:
            dtype = self.raw[f"{module}.weight_packed"][0].get_slice(self.raw[f"{module}.weight_packed"][1]).get_dtype()
            found = "pack-quantized" if dtype == "I32" else "nvfp4-pack-quantized"
        elif "weight" in params:
            dtype = self.raw[f"{module}.weight"][0].get_slice(self.raw[f"{module}.weight"][1]).get_dtype()
            found = {"I8": "int-quantized", "F8_E4M3": "float-quantized"}.get(dtype, f"{dtype} weights")
        else:
            raise CheckpointError(f"{self.dir} lacks {module}.weight_packed and {module}.weight")
        if declared not in (None, "mixed-precision", found):
            raise CheckpointError(f"{module} is stored as {found} but quantization_config declares the format {declared}")
        return found

    def detect_mode(self) -> QuantizationMode:
        experts = [fmt for m, (_, fmt, _, _) in self.specs.items() if ".experts." in m]
        counts = Counter(experts or [fmt for _, fmt, _, _ in self.specs.values()])
        return FORMAT_MODES[counts.most_common(1)[0][0]]

    # --- tensors -> containers --------------------------------------------------------------
    def module_weight(self, name: str, module: str):
        group, fmt, w_args, ct_format = self.specs[module]
        params = self.modules[module]
        t = lambda p: self.tensor(f"{module}.{p}")  # noqa: E731
        scale = t("weight_scale")

        def bad(what: str):
            raise CheckpointError(f"{module}.{what} does not match config group {group!r} ({_args_summary(w_args)})")

        if fmt in ("int4", "w4a8"):
            if ct_format == "pack-quantized":
                n, k = (int(v) for v in t("weight_shape").tolist())
                packed = t("weight_packed")
                if packed.dtype != torch.int32 or tuple(packed.shape) != (n, -(-k // 8)) or k % 2:
                    bad(f"weight_packed (shape {tuple(packed.shape)}, weight_shape {(n, k)})")
                # eight values per int32, element i at bits 4i..4i+3 stored as q + 8: the bytes hold
                # two values each, low nibble first, as llama-lite's packing; xor 8 turns q + 8 into q.
                qweight = (packed.contiguous().view(torch.uint8)[:, : k // 2] ^ 0x88).contiguous()
            else:
                values = t("weight")
                n, k = values.shape
                if values.dim() != 2 or int(values.min()) < -8 or int(values.max()) > 7 or k % 2:
                    bad("weight (int8 values outside [-8, 7])")
                qweight = pack_int4(values)
            gs = w_args.get("group_size") if w_args.get("strategy") == "group" else k
            if not gs or k % gs or tuple(scale.shape) != (n, k // gs):
                bad(f"weight_scale (shape {tuple(scale.shape)}, expected {(n, k // gs if gs else '?')})")
            if "weight_zero_point" in params and bool(t("weight_zero_point").any()):
                bad("weight_zero_point (non-zero zero points in a symmetric scheme)")
            if "weight_g_idx" in params:
                g_idx = t("weight_g_idx")
                if not torch.equal(g_idx.long(), torch.arange(k) // gs):
                    bad("weight_g_idx (activation reordering is not supported)")
            scales = scale if scale.dtype in (torch.bfloat16, torch.float32) else scale.float()
            w = Int4Weight(qweight=qweight, scales=scales, group_size=gs)
            if fmt == "w4a8":
                w = w4a8_from_int4(w)
                w.activation_scale_ub = NO_SCALE_BOUND
            return w
        if fmt == "fp8":
            weight = t("weight")
            if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
                bad(f"weight (dtype {weight.dtype})")
            n = weight.shape[0]
            if scale.numel() == 1 and w_args.get("strategy") == "tensor":
                s = scale.float().reshape(1).expand(n).contiguous()  # one scale for every row: exact
            elif tuple(scale.shape) in ((n, 1), (n,)):
                s = scale.float().reshape(n)
            else:
                bad(f"weight_scale (shape {tuple(scale.shape)}, expected {(n, 1)})")
            return Fp8Weight(weight=weight, scale=s, activation_scale_ub=NO_SCALE_BOUND)
        packed = t("weight_packed")
        n, half = packed.shape
        if packed.dtype != torch.uint8 or tuple(scale.shape) != (n, half * 2 // 16) or scale.dtype != torch.float8_e4m3fn:
            bad(f"weight_scale (shape {tuple(scale.shape)}, dtype {scale.dtype}; expected {(n, half * 2 // 16)} e4m3)")
        g = t("weight_global_scale").float()
        if g.numel() != 1:
            bad(f"weight_global_scale (shape {tuple(g.shape)}, expected one value)")
        g_in = None
        if self.groups[group].get("input_activations"):
            g_in = t("input_global_scale").float()
            if g_in.numel() != 1:
                bad(f"input_global_scale (shape {tuple(g_in.shape)}, expected one value)")
            g_in = g_in.reshape(())
        # e2m1 codes two per byte, the even element in the low nibble: llama-lite's packing.
        return NVFP4Weight(qweight=packed, scales=scale, global_scale=g.reshape(()), input_global_scale=g_in)
