"""Modules that replace the core's Experts, FeedForward and parallel linear layers.

They hold kernels' weight containers (not nn.Parameters) and call kernels' fused functions;
their forward signatures match the modules they replace.
"""

import torch
from torch import nn

import kernels
import kernels.formats
from llama_lite.model import each_expert, gather_parallel, reduce_parallel
from kernels.formats import QuantizedWeight


class QuantizedExperts(nn.Module):
    """Routed experts; weights in nn.Linear orientation: w1/w3 [E, F, D], w2 [E, D, F]."""

    def __init__(self, w1: QuantizedWeight, w3: QuantizedWeight, w2: QuantizedWeight):
        super().__init__()
        self.w1, self.w3, self.w2 = w1, w3, w2
        self.num_experts = kernels.formats.weight_shape(w1)[0]

    def forward(self, x_TD: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
        return kernels.grouped_swiglu(x_TD, offsets_E1, self.w1, self.w3, self.w2)

    def extra_repr(self) -> str:
        return f"{type(self.w1).__name__}, experts={self.num_experts}"


class QuantizedFeedForward(nn.Module):
    """SwiGLU with quantized w1/w3 (column-parallel) and w2 (row-parallel)."""

    def __init__(self, w1: QuantizedWeight, w3: QuantizedWeight, w2: QuantizedWeight, do_reduce: bool):
        super().__init__()
        self.w1, self.w3, self.w2, self.do_reduce = w1, w3, w2, do_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = kernels.swiglu(x, self.w1, self.w3, self.w2)
        return reduce_parallel(out) if self.do_reduce else out

    def extra_repr(self) -> str:
        return type(self.w1).__name__


class _ParallelKernelLinear(nn.Module):
    """A column- or row-parallel linear layer whose product is ``kernels.linear``."""

    def __init__(self, weight, parallel: str, gather_output: bool = False):
        super().__init__()
        self.weight, self.parallel, self.gather_output = weight, parallel, gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = kernels.linear(x, self.weight)
        if self.parallel == "row":
            return reduce_parallel(out)
        return gather_parallel(out) if self.gather_output else out


class QuantizedLinear(_ParallelKernelLinear):
    """A column- or row-parallel linear layer with a quantized weight."""

    def __init__(self, weight: QuantizedWeight, parallel: str, gather_output: bool = False):
        super().__init__(weight, parallel, gather_output)

    def extra_repr(self) -> str:
        return f"{type(self.weight).__name__}, {self.parallel}-parallel"


class KernelLinear(_ParallelKernelLinear):
    """A column- or row-parallel linear layer left in bf16, computed by ``kernels.linear``.

    Same weight and numbers as the core's layer (fp32 accumulation, bf16 result); it exists so
    that on a CPU the layers a mode leaves in bf16 (attention, output) also use the kernels'
    GEMV, which reads a bf16 weight faster at decode than PyTorch's matrix-vector product.
    """

    def __init__(self, weight: torch.Tensor, parallel: str, gather_output: bool = False):
        super().__init__(nn.Parameter(weight, requires_grad=False), parallel, gather_output)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, {self.weight.dtype}, {self.parallel}-parallel"


class KernelFeedForward(nn.Module):
    """A dense SwiGLU (shared expert, dense layers) left in bf16, each product by ``kernels.linear``.

    The core's FeedForward computed the same way (bf16 products, SwiGLU in bf16), so prefill gives
    the core's numbers exactly and decode reads its weights with the kernels' bf16 GEMV.
    """

    def __init__(self, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, do_reduce: bool):
        super().__init__()
        self.w1, self.w3, self.w2 = (nn.Parameter(w, requires_grad=False) for w in (w1, w3, w2))
        self.do_reduce = do_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.silu(kernels.linear(x, self.w1)) * kernels.linear(x, self.w3)
        out = kernels.linear(h, self.w2)
        return reduce_parallel(out) if self.do_reduce else out

    def extra_repr(self) -> str:
        return f"{tuple(self.w1.shape)}, {self.w1.dtype}"


def bf16_experts_eager(x_TD: torch.Tensor, offsets_E1: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                       w2: torch.Tensor) -> torch.Tensor:
    """Routed experts with plain weights in nn.Linear orientation (w1/w3 [E, F, D], w2 [E, D, F]),
    each product by ``kernels.linear`` in x.dtype."""
    return each_expert(x_TD, offsets_E1, lambda e, x: kernels.linear(
        nn.functional.silu(kernels.linear(x, w1[e])) * kernels.linear(x, w3[e]), w2[e]))


# Reads the offsets on the host: CUDA graphs leave it out.
bf16_experts = torch.library.custom_op("llama_lite_quantization::bf16_experts", bf16_experts_eager, mutates_args=(),
                                       tags=(torch.Tag.cudagraph_unsafe,))


@bf16_experts.register_fake
def _(x_TD, offsets_E1, w1, w3, w2):
    return torch.empty_like(x_TD)


class KernelExperts(nn.Module):
    """Routed experts left in bf16, in nn.Linear orientation (w1/w3 [E, F, D], w2 [E, D, F],
    contiguous), each expert's products by ``kernels.linear``: the core's Experts computed the same
    way, with the kernels' bf16 GEMV at decode."""

    def __init__(self, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w1, self.w3, self.w2 = (nn.Parameter(w, requires_grad=False) for w in (w1, w3, w2))
        self.num_experts = w1.shape[0]

    def forward(self, x_TD: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
        # a loop over the routing's bounds, one opaque operator when compiled
        fn = bf16_experts if torch.compiler.is_compiling() else bf16_experts_eager
        return fn(x_TD, offsets_E1, self.w1, self.w3, self.w2)

    def extra_repr(self) -> str:
        return f"bf16, experts={self.num_experts}"


def _logical_numel(w: QuantizedWeight) -> int:
    packed = getattr(w, "qweight", None)
    return packed.numel() * 2 if packed is not None else w.weight.numel()


def model_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes stored, bytes the same weights take in bf16) over parameters and quantized weights."""
    from .sharding import tensor_fields

    stored = bf16 = 0
    for p in model.parameters():
        stored += p.numel() * p.element_size()
        bf16 += p.numel() * 2
    for module in model.modules():
        for w in vars(module).values():
            if isinstance(w, (kernels.formats.Int4Weight, kernels.formats.Fp8Weight, kernels.formats.W4A8Weight,
                              kernels.formats.NVFP4Weight)):
                stored += sum(t.numel() * t.element_size() for t in tensor_fields(w).values())
                bf16 += _logical_numel(w) * 2
    return stored, bf16
