"""Quantization modes and which parts of the model each one quantizes by default."""

from enum import Enum

from llama_lite.errors import ConfigError


class QuantizationMode(str, Enum):
    none = "none"
    int4_mixed = "int4_mixed"
    fp8_mixed = "fp8_mixed"
    w4a8 = "w4a8"
    nvfp4 = "nvfp4"


# Targets: routed experts, the MoE layers' shared expert, dense FFN layers, attention
# projections, and the output (vocabulary) projection.
ALL_TARGETS = ("experts", "shared_expert", "ffn", "attention", "output")

DEFAULT_TARGETS = {
    QuantizationMode.int4_mixed: ("experts", "shared_expert"),
    QuantizationMode.fp8_mixed: ("experts",),
    QuantizationMode.w4a8: ("experts", "shared_expert"),
    QuantizationMode.nvfp4: ("experts", "shared_expert"),
}

# The format each mode stores its weights in.
MODE_FORMAT = {
    QuantizationMode.int4_mixed: "int4",
    QuantizationMode.fp8_mixed: "fp8",
    QuantizationMode.w4a8: "w4a8",
    QuantizationMode.nvfp4: "nvfp4",
}


def parse_mode(mode) -> QuantizationMode:
    if isinstance(mode, QuantizationMode):
        return mode
    try:
        return QuantizationMode(str(mode) if mode is not None else "none")
    except ValueError:
        choices = ", ".join(m.value for m in QuantizationMode)
        raise ConfigError(f"unknown quantization mode {mode!r}; choose one of {choices}") from None


def parse_targets(mode: QuantizationMode, targets=None) -> tuple[str, ...]:
    """Targets as a tuple: None = the mode's default, "all", or a comma-separated string / list."""
    if targets is None:
        return DEFAULT_TARGETS.get(mode, ())
    if isinstance(targets, str):
        targets = ALL_TARGETS if targets == "all" else [t.strip() for t in targets.split(",") if t.strip()]
    unknown = sorted(set(targets) - set(ALL_TARGETS))
    if unknown:
        raise ConfigError(f"unknown quantization target(s) {', '.join(unknown)}; choose from {', '.join(ALL_TARGETS)}")
    return tuple(t for t in ALL_TARGETS if t in targets)
