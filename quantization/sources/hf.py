"""What every Hugging Face quantized folder shares: reading its tensors, naming its modules the
way llama-lite does, per-expert and fused expert layouts, and the quantized loader's interface.

A subclass says, per Hugging Face module, whether it is stored quantized and how to turn its
tensors into one of llama-lite's weight containers (``module_weight``); this class stacks
per-expert modules into ``[E, N, K]`` weights, hands out bf16 tensors for the rest, checks
shapes against the model, and resolves the quantization mode.
"""

import re
from dataclasses import fields
from pathlib import Path
from typing import Optional

import torch

from kernels.formats import QuantizedWeight, weight_shape
from llama_lite.checkpoint import Checkpoint, release_file_pages, split_axis
from llama_lite.errors import CheckpointError, ConfigError
from llama_lite.model import MoE, Transformer

from ..formats import w4a8_from_int4
from ..modes import QuantizationMode

_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")

# Hugging Face linear module (text model, prefixes stripped) -> llama-lite weight name.
_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}
_MODULE_RULES = [
    (re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_proj$"), lambda m: f"layers.{m[1]}.attention.w{m[2]}.weight"),
    (re.compile(r"^model\.layers\.(\d+)\.feed_forward\.(shared_expert\.)?(gate|up|down)_proj$"),
     lambda m: f"layers.{m[1]}.feed_forward.{m[2] or ''}{_PROJ[m[3]]}.weight"),
    (re.compile(r"^lm_head$"), lambda m: "output.weight"),
]
_EXPERT_RULE = re.compile(r"^model\.layers\.(\d+)\.feed_forward\.experts\.(\d+)\.(gate|up|down)_proj$")
_ROUTER_RULE = re.compile(r"^model\.layers\.(\d+)\.feed_forward\.router$")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def text_name(raw: str) -> str:
    """A stored tensor or module name with the multimodal wrapper's prefix removed."""
    for prefix in _TEXT_PREFIXES:
        if raw.startswith(prefix):
            rest = raw[len(prefix):]
            return rest if rest.startswith(("model.", "lm_head")) else "model." + rest
    return raw


def llama_name(module: str) -> Optional[tuple[str, Optional[int]]]:
    """(llama-lite weight name, expert index or None) of a Hugging Face linear module, or None."""
    for pattern, make in _MODULE_RULES:
        m = pattern.match(module)
        if m:
            return make(m), None
    m = _EXPERT_RULE.match(module)
    if m:
        return f"layers.{m[1]}.feed_forward.experts.{_PROJ[m[3]]}", int(m[2])
    return None


def stack_experts(weights: list) -> "QuantizedWeight | torch.Tensor":
    """Per-expert 2-D weights of one format -> one ``[E, N, K]`` weight (0-d global scales -> [E])."""
    first = weights[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(weights)
    if any(type(w) is not type(first) for w in weights):
        kinds = sorted({type(w).__name__ for w in weights})
        raise CheckpointError(f"the experts of one layer are stored in different formats ({', '.join(kinds)})")
    kwargs = {}
    for f in fields(first):
        value = getattr(first, f.name)
        if f.name == "prepared":
            continue
        if isinstance(value, torch.Tensor):
            kwargs[f.name] = torch.stack([getattr(w, f.name) for w in weights])
        elif value is None or not isinstance(value, torch.Tensor):
            if any(getattr(w, f.name) != value for w in weights):
                raise CheckpointError(f"the experts of one layer disagree on {f.name}")
            kwargs[f.name] = value
    return type(first)(**kwargs)


class HFQuantizedSource:
    """Weights of a Hugging Face folder with ``quantization_config``, under llama-lite's names."""

    label = "quantized"

    def __init__(self, checkpoint: Checkpoint, mode: QuantizationMode, qcfg: dict):
        from safetensors import SafetensorError, safe_open

        self.ckpt, self.qcfg = checkpoint, qcfg
        self.dir = Path(checkpoint.dir)
        self.args = checkpoint.args
        self.files = sorted(self.dir.glob("*.safetensors"))
        self.raw: dict[str, tuple] = {}  # text-model tensor name -> (handle, stored name)
        for path in self.files:
            try:
                handle = safe_open(str(path), framework="pt")
                names = list(handle.keys())
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read {path}: corrupted safetensors file ({e})") from None
            for stored in names:
                self.raw[text_name(stored)] = (handle, stored)
        # module -> {parameter: stored tensor name}, for every module that holds parameters
        self.modules: dict[str, dict[str, str]] = {}
        for name, (_, stored) in self.raw.items():
            module, _, param = name.rpartition(".")
            self.modules.setdefault(module, {})[param] = stored
        self.bf16_view = Checkpoint(self.dir, self.args, world_size=1, rank=0)
        # llama-lite weight name -> [(module, expert index or None)] of every module it comes from
        self.sources: dict[str, list[tuple[str, Optional[int]]]] = {}
        for module in self.modules:
            mapped = llama_name(module)
            if mapped is not None:
                self.sources.setdefault(mapped[0], []).append((module, mapped[1]))
        for entries in self.sources.values():
            entries.sort(key=lambda e: -1 if e[1] is None else e[1])
        self.quantized: set[str] = set()  # llama-lite weights stored quantized: set by the subclass
        self.scan()
        self.detected = self.detect_mode()
        self.derive_w4a8 = False
        if mode != QuantizationMode.none and mode != self.detected:
            if mode == QuantizationMode.w4a8 and self.detected == QuantizationMode.int4_mixed:
                self.derive_w4a8 = True  # w4a8 is derived from w4a16 group scales
            else:
                raise ConfigError(
                    f"{self.dir} is a {self.label} checkpoint that runs as {self.detected.value}; "
                    f"--quantization_mode {mode.value} conflicts with it (omit the flag)"
                )
        self.mode = mode if mode != QuantizationMode.none else self.detected
        self.shapes: dict[str, tuple] = {}

    # --- what a subclass provides -------------------------------------------------------
    def scan(self) -> None:
        """Fill ``self.quantized`` (and anything else needed) from the config and the tensors."""
        raise NotImplementedError

    def detect_mode(self) -> QuantizationMode:
        raise NotImplementedError

    def module_weight(self, name: str, module: str) -> QuantizedWeight:
        """The container of one stored quantized module (2-D, nn.Linear orientation)."""
        raise NotImplementedError

    # --- reading ------------------------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor:
        """A stored tensor by its text-model name."""
        if name not in self.raw:
            raise CheckpointError(f"{self.dir} lacks the tensor {name!r}")
        handle, stored = self.raw[name]
        try:
            return handle.get_tensor(stored)
        except Exception as e:  # safetensors raises its own error types for truncated data
            raise CheckpointError(f"cannot read tensor {stored!r} from {self.dir}: {e}") from None

    def stored_quantized(self, module: str) -> bool:
        """Whether a module's tensors are a quantized encoding (not a plain float weight)."""
        params = self.modules.get(module, {})
        if set(params) - {"weight", "bias"}:
            return True
        if "weight" in params:
            handle, stored = self.raw[f"{module}.weight"]
            return handle.get_slice(stored).get_dtype() not in ("BF16", "F16", "F32")
        return False

    # --- the quantized loader's interface -------------------------------------------------
    def plan(self, model: Transformer, targets=None) -> list[tuple[str, str]]:
        """(module path, kind) of every llama-lite module that holds a stored quantized weight."""
        if targets is not None:
            raise ConfigError(f"{self.dir} is a {self.label} checkpoint: it brings its own targets, so do not pass targets")
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        q = self.quantized
        plan = []
        for block in model.layers:
            p = f"layers.{block.layer_id}.feed_forward."
            if isinstance(block.feed_forward, MoE):
                if any(f"{p}experts.{w}" in q for w in ("w1", "w3", "w2")):
                    plan.append((p + "experts", "experts"))
                if any(f"{p}shared_expert.{w}.weight" in q for w in ("w1", "w3", "w2")):
                    plan.append((p + "shared_expert", "ffn"))
            elif any(f"{p}{w}.weight" in q for w in ("w1", "w3", "w2")):
                plan.append((p[:-1], "ffn"))
            a = f"layers.{block.layer_id}.attention."
            plan += [(a + f"w{n}", "row" if n == "o" else "column") for n in "qkvo" if f"{a}w{n}.weight" in q]
        if "output.weight" in q:
            plan.append(("output", "output"))
        return plan

    def _expected(self, name: str) -> Optional[tuple]:
        """The nn.Linear-orientation shape the model expects for a weight."""
        shape = self.shapes.get(name)
        if shape is None:
            return None
        shape = list(shape)  # this rank's part: the whole weight is world size times larger along its split
        axis = split_axis(name)
        if axis is not None:
            shape[axis] *= self.ckpt.world_size
        return (shape[0], shape[2], shape[1]) if len(shape) == 3 else tuple(shape)

    def prequantized(self, name: str) -> "QuantizedWeight | torch.Tensor":
        """The whole weight of a planned module: its container if stored quantized, else bf16."""
        if name not in self.quantized:
            t = self.whole(name)
            return t.transpose(-1, -2) if t.dim() == 3 else t
        entries = self.sources[name]
        parts = [self.module_weight(name, module) for module, _ in entries]
        if entries[0][1] is None:
            w = parts[0]
        else:
            self._check_experts(name, [e for _, e in entries])
            w = stack_experts(parts)
        e, n, k = weight_shape(w)
        got = (n, k) if e is None else (e, n, k)
        want = self._expected(name)
        if want is not None and got != want:
            raise CheckpointError(
                f"the quantized weight {entries[0][0]} has shape {got} in {self.dir} but the model expects {want} "
                "(config.json does not match the weights)"
            )
        if self.derive_w4a8:
            from kernels.formats import Int4Weight

            if isinstance(w, Int4Weight):
                w = w4a8_from_int4(w)
        return w

    def _check_experts(self, name: str, found: list) -> None:
        e = self.args.moe_args.num_experts if self.args.moe_args else 1
        if found != list(range(e)):
            missing = sorted(set(range(e)) - set(found))
            raise CheckpointError(
                f"{self.dir} lacks expert {missing[0] if missing else found[-1]} of {name} "
                f"(the config has {e} experts; found {len(found)})"
            )

    def whole(self, name: str) -> torch.Tensor:
        """A weight left in bf16, whole, in the core's orientation."""
        entries = self.sources.get(name)
        if entries and entries[0][1] is not None:
            self._check_experts(name, [e for _, e in entries])
            return torch.stack([self._plain(m).t() for m, _ in entries])  # [E, K, N] as the core stores it
        if entries:
            return self._plain(entries[0][0])
        return self.bf16_view.get(name)

    def _plain(self, module: str) -> torch.Tensor:
        if self.stored_quantized(module):
            raise CheckpointError(
                f"{self.dir} stores {module} quantized, but its quantization_config does not cover that module"
            )
        return self.tensor(f"{module}.weight")

    def rank_part(self, name: str) -> torch.Tensor:
        if name.endswith("router_DE"):
            module = self._router_module(name)
            if module is not None and self.stored_quantized(module):
                raise CheckpointError(f"{self.dir} stores the router {module} quantized; llama-lite keeps routers in bf16")
        t = self.whole(name)
        axis, world = split_axis(name), self.ckpt.world_size
        if axis is None or world == 1:
            return t
        if t.shape[axis] % world:
            raise CheckpointError(f"tensor {name!r} of shape {tuple(t.shape)} cannot be split {world} ways")
        return t.chunk(world, dim=axis)[self.ckpt.rank]

    def _router_module(self, name: str) -> Optional[str]:
        layer = name.split(".")[1]
        module = f"model.layers.{layer}.feed_forward.router"
        return module if module in self.modules else None

    def release(self, within: Optional[tuple[int, int]] = None) -> None:
        release_file_pages(self.files, within)
        self.bf16_view.release(within)
