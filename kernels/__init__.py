"""Fused compute for llama-lite: linear / grouped (MoE) / SwiGLU kernels for every weight format.

    from kernels import linear, grouped_linear, grouped_swiglu, swiglu, prepare, set_backend

Weights are ``kernels.formats`` containers (``Int4Weight``, ``Fp8Weight``, ``W4A8Weight``,
``NVFP4Weight``) or plain tensors. ``kernels.reference`` defines the numerics; ``kernels.cpu`` and
``kernels.triton_kernels`` are the fast paths, chosen by ``kernels.dispatch``; ``kernels.entry``
holds the public calls (custom operators of ``kernels.ops`` while ``torch.compile`` traces). ``decode_attention``
(``kernels.attention``) is a decode step's attention over a KV cache; ``rmsnorm`` (``kernels.norm``)
an RMSNorm of bf16 rows in one call; ``moe_one_token`` (``kernels.moe``) a MoE layer for one token in one call,
``OneTokenAttention`` (``kernels.attention_layer``) an attention layer's decode step for one token in one call,
``one_token_block`` (``kernels.block_layer``) a whole decoder block (both) for one token in one call,
``plan_blocks`` / ``run_blocks`` every block of a decode step in one call.
"""

from .attention import decode_attention, decode_step, prefill_attention
from .attention_layer import OneTokenAttention
from .block_layer import one_token_block, plan_blocks, run_blocks
from .dispatch import BACKENDS, get_backend, set_backend
from .entry import grouped_linear, grouped_swiglu, linear, prepare, swiglu
from .moe import moe_one_token
from .norm import rmsnorm
from .formats import (
    Fp8Weight,
    Int4Weight,
    NVFP4Weight,
    QuantizedWeight,
    W4A8Weight,
    dequantize_weight,
    format_name,
    pack_fp4,
    pack_int4,
    select_expert,
    unpack_fp4,
    unpack_int4,
    weight_shape,
)

__all__ = [
    "BACKENDS", "get_backend", "set_backend", "prepare",
    "linear", "grouped_linear", "grouped_swiglu", "swiglu", "decode_attention", "decode_step", "prefill_attention", "rmsnorm",
    "moe_one_token", "OneTokenAttention", "one_token_block", "plan_blocks", "run_blocks",
    "Int4Weight", "Fp8Weight", "W4A8Weight", "NVFP4Weight", "QuantizedWeight",
    "dequantize_weight", "format_name", "weight_shape", "select_expert",
    "pack_int4", "unpack_int4", "pack_fp4", "unpack_fp4",
]  # fmt: skip
