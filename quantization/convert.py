"""convert_to_quantized_model: the quantized loader handed to ``Llama4.build(convert=...)``.

It walks the meta-device model one layer at a time, swaps the targeted modules for quantized
ones and loads every weight, so the bf16 model is never materialised whole. Sources, in order:
a Hugging Face quantized folder (compressed-tensors or fbgemm_fp8, see ``quantization.sources``),
this package's pre-quantized format (quantization.json), llama-models' pre-quantized layout
(int4_scales_N.pt / fp8_scales_N.pt beside consolidated.NN.pth), or bf16 weights quantized on
the fly. A source also settles the mode (a quantized folder knows its own) and the modules to
swap. Each weight is quantized whole and then sliced for this rank, so every world size sees
the same numbers.
"""

import ctypes
import logging
import weakref
from dataclasses import replace
from functools import partial
from typing import Optional

import fairscale.nn.model_parallel.initialize as fs_init
import torch
from torch import nn

import kernels
from kernels.formats import QuantizedWeight
from kernels.memory import huge_page_copy, huge_page_empty
from llama_lite.checkpoint import Checkpoint, loaded_tensor, set_tensor
from llama_lite.errors import CheckpointError, ConfigError
from llama_lite.kv_cache import RingCache, register_attention
from llama_lite.model import (
    Attention, ColumnParallelLinear, Experts, FeedForward, MoE, RMSNorm, RowParallelLinear, Transformer,
    TransformerBlock,
)

from .checkpoint_io import (
    QuantizedCheckpoint,
    llama_models_expert,
    llama_models_scale_files,
    load_llama_models_scales,
    read_quant_config,
)
from .formats import quantize_fp8_rowwise, quantize_int4, quantize_nvfp4, quantize_w4a8, w4a8_from_int4
from .modes import MODE_FORMAT, QuantizationMode, parse_mode, parse_targets
from .modules import KernelExperts, KernelFeedForward, KernelLinear, QuantizedExperts, QuantizedFeedForward, QuantizedLinear
from .sharding import slice_weight, stack_experts, tensor_fields
from .sources import hf_quantization_config, open_hf_source

log = logging.getLogger("llama_lite.quantization")


def contiguous_weight(w: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``w.contiguous()``, written into ``out`` (w's shape and dtype) when given and a copy is needed.

    Meta's checkpoints store routed experts as [E, K, N], so their [E, N, K] view has its last two
    dims transposed in memory; that is copied 16 values of K at a time, which took a bench-preset
    expert stack (8 x 4096 x 2048 bf16) 94 ms against 348 for PyTorch's one-pass transposing copy
    (one expert: about the same), and 1.1 s to quantize to int4 without copying (reductions over a
    strided K)."""
    if w.is_contiguous() or w.dim() < 2 or w.stride(-2) != 1 or w.device.type != "cpu":
        return w.contiguous()
    out = torch.empty(w.shape, dtype=w.dtype) if out is None else out
    for k0 in range(0, w.shape[-1], 16):
        out[..., k0 : k0 + 16] = w[..., k0 : k0 + 16]
    return out


def quantize_weight(w: torch.Tensor, fmt: str, group_size: int = 128, fp8_activation_scale_ub: float = 1200.0,
                    nvfp4_activation_amax: Optional[float] = None) -> QuantizedWeight:
    """Quantize one bf16 weight in nn.Linear orientation ([..., N, K]) to ``fmt``."""
    k = w.shape[-1]
    if fmt in ("int4", "w4a8") and k % group_size:
        raise ConfigError(f"group size {group_size} does not divide the weight's input size {k}")
    if fmt == "nvfp4" and k % 16:
        raise ConfigError(f"nvfp4 needs input sizes divisible by 16, got {k}")
    if fmt not in ("int4", "fp8", "w4a8", "nvfp4"):
        raise ConfigError(f"unknown weight format {fmt!r}")
    one = partial(_quantize_contiguous, fmt=fmt, group_size=group_size, fp8_activation_scale_ub=fp8_activation_scale_ub,
                  nvfp4_activation_amax=nvfp4_activation_amax)
    if w.dim() == 3 and w.shape[0] > 1:
        # Experts quantize independently (nvfp4's global scale is per expert too): one at a time, so
        # the temporaries are one expert's size, and in cache; a strided stack's experts are copied
        # contiguous into one buffer in turn, not into fresh pages each.
        scratch = None if w[0].is_contiguous() else torch.empty(w.shape[1:], dtype=w.dtype)
        return stack_experts([one(contiguous_weight(w[e], scratch)) for e in range(len(w))])
    return one(contiguous_weight(w))


def _quantize_contiguous(w: torch.Tensor, fmt: str, group_size: int, fp8_activation_scale_ub: float,
                         nvfp4_activation_amax: Optional[float]) -> QuantizedWeight:
    if fmt == "int4":
        return quantize_int4(w, group_size)
    if fmt == "fp8":
        return quantize_fp8_rowwise(w, fp8_activation_scale_ub)
    if fmt == "w4a8":
        return quantize_w4a8(w, group_size)
    g_in = None
    if nvfp4_activation_amax is not None:
        g_in = torch.full(w.shape[:-2], 448.0 * 6.0 / nvfp4_activation_amax, dtype=torch.float32)
    return quantize_nvfp4(w, g_in)


class _Source:
    """Whole tensors for a weight name, quantized or bf16, from whichever files the folder holds."""

    def __init__(self, checkpoint: Checkpoint, mode: QuantizationMode):
        self.ckpt, self.mode = checkpoint, mode
        cfg = read_quant_config(checkpoint.dir)
        self.ours = None
        self.lm_scales: list[dict] = []
        self.derive_w4a8 = False
        if cfg is not None:
            stored = cfg.get("quantization_mode")
            # w4a8 is derived from w4a16 group scales, so an int4 checkpoint serves it too.
            self.derive_w4a8 = stored == QuantizationMode.int4_mixed.value and mode == QuantizationMode.w4a8
            if stored != mode.value and not self.derive_w4a8:
                raise CheckpointError(
                    f"{checkpoint.dir} was quantized as {stored}; load it with --quantization_mode {stored}"
                )
            self.ours = QuantizedCheckpoint(checkpoint.dir, cfg)
        else:
            files = llama_models_scale_files(checkpoint.dir, mode.value)
            self.lm_scales = load_llama_models_scales(files)
        # The whole-model view (world size 1) that on-the-fly quantization reads from.
        self.full = Checkpoint(checkpoint.dir, checkpoint.args, world_size=1, rank=0) if self.ours is None else None

    @property
    def targets(self) -> Optional[tuple]:
        return self.ours.targets if self.ours is not None else None

    def plan(self, model: Transformer, targets=None) -> list[tuple[str, str]]:
        chosen = self.targets if self.targets is not None and targets is None else parse_targets(self.mode, targets)
        return _plan(model, chosen, self.mode)

    def prequantized(self, name: str) -> Optional[QuantizedWeight]:
        if self.ours is not None:
            if not self.ours.is_quantized(name):
                return None
            w = self.ours.quantized(name)
            return w4a8_from_int4(w) if self.derive_w4a8 else w
        if self.lm_scales and ".experts." in name and name in self.lm_scales[0]:
            packed = self.full.get(name)
            if len(self.lm_scales) != self.full.source_mp:
                raise CheckpointError(
                    f"{self.ckpt.dir} holds {len(self.lm_scales)} scale files for {self.full.source_mp} weight shards"
                )
            scales = [s[name] for s in self.lm_scales]
            return llama_models_expert(packed, scales, self.mode.value, name.rsplit(".", 1)[1])
        return None

    def release(self, within: Optional[tuple[int, int]] = None) -> None:
        """Drop this process's pages of the checkpoint's files (``within``: of that address range)."""
        for ckpt in (self.full, self.ckpt):
            if ckpt is not None:
                ckpt.release(within)
        if self.ours is not None:
            self.ours.release(within)

    def whole(self, name: str) -> torch.Tensor:
        return self.ours.bf16(name) if self.ours is not None else self.full.get(name)

    def rank_part(self, name: str) -> torch.Tensor:
        if self.ours is None:
            return self.ckpt.get(name)
        from llama_lite.checkpoint import split_axis

        t, axis = self.ours.bf16(name), split_axis(name)
        if axis is None or self.ckpt.world_size == 1:
            return t
        return t.chunk(self.ckpt.world_size, dim=axis)[self.ckpt.rank]


def _plan(model: Transformer, targets: tuple, mode: QuantizationMode) -> list[tuple[str, str]]:
    """(module path, kind) of every module to quantize."""
    plan = []
    last = model.n_layers - 1
    for block in model.layers:
        p = f"layers.{block.layer_id}."
        ff = block.feed_forward
        if isinstance(ff, MoE):
            # fp8_mixed leaves the first and last layers' experts in bf16, as Meta's reference does.
            skip = mode == QuantizationMode.fp8_mixed and block.layer_id in (0, last)
            if "experts" in targets and not skip:
                plan.append((p + "feed_forward.experts", "experts"))
            if "shared_expert" in targets:
                plan.append((p + "feed_forward.shared_expert", "ffn"))
        elif "ffn" in targets:
            plan.append((p + "feed_forward", "ffn"))
        if "attention" in targets:
            plan += [(p + f"attention.w{n}", "column") for n in "qkv"] + [(p + "attention.wo", "row")]
    if "output" in targets:
        plan.append(("output", "output"))
    return plan


def _weights_of(kind: str) -> list[tuple[str, str, bool]]:
    """(parameter name under the module, split, whether stored transposed [.., K, N] in the core)."""
    if kind == "experts":
        return [("w1", "N", True), ("w3", "N", True), ("w2", "K", True)]
    if kind == "ffn":
        return [("w1.weight", "N", False), ("w3.weight", "N", False), ("w2.weight", "K", False)]
    return [("weight", "K" if kind == "row" else "N", False)]


def _return_freed_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Quantizing a layer allocates and frees large transients; glibc keeps much of that memory, which
    then counts as the process's own: ~45 MiB on the small preset, varying from run to run."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = lambda pad: 0  # noqa: E731 -- not glibc
    _malloc_trim(0)


_malloc_trim = None


def _linear_layout(w: torch.Tensor) -> torch.Tensor:
    """Core expert weights [E, D, F] / [E, F, D] as contiguous nn.Linear-oriented [E, N, K], one expert
    at a time, in 2 MiB pages (kernels.memory) on a CPU: decode reads them once per token."""
    shape = (w.shape[0], w.shape[2], w.shape[1])
    t = huge_page_empty(shape, w.dtype) if w.device.type == "cpu" else None
    if t is None:
        t = torch.empty(shape, dtype=w.dtype, device=w.device)
    for e in range(w.shape[0]):
        t[e].copy_(w[e].T)
    return t


def _bf16_layers_to_kernels(model: Transformer, prefix: str) -> None:
    """Swap the core's bf16 layers under ``prefix`` ("" = outside the layers) for modules that compute
    the same products with ``kernels.linear``: parallel linear layers, dense SwiGLUs and routed experts
    (so every weight read at decode goes through the kernels' bf16 GEMV)."""
    swapped: list[str] = []
    for path, module in list(model.named_modules()):
        inside = path.startswith(prefix) if prefix else not path.startswith("layers.")
        if not inside or any(path.startswith(done + ".") for done in swapped):
            continue
        if isinstance(module, Experts):
            new = KernelExperts(*(_linear_layout(getattr(module, n).data) for n in ("w1", "w3", "w2")))
        elif isinstance(module, FeedForward):
            new = KernelFeedForward(module.w1.weight.data, module.w3.weight.data, module.w2.weight.data, module.do_reduce)
        elif isinstance(module, RowParallelLinear):
            new = KernelLinear(module.weight.data, "row")
        elif isinstance(module, ColumnParallelLinear):
            new = KernelLinear(module.weight.data, "column", gather_output=module.gather_output)
        else:
            continue
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        swapped.append(path)


def _attention_to_kernels(model: Transformer) -> None:
    """Let decode steps attend over the KV cache with ``kernels.decode_attention``: on a CPU PyTorch's
    SDPA takes 10-25x as long as reading the cache (an AMD EPYC without AVX-512 BF16). Where it
    applies, ``kernels.decode_step`` also writes the cache in the same call. Every RMSNorm (the
    layers' and the query/key heads') runs as one ``kernels.rmsnorm`` call where it applies, and a
    MoE layer whose routed and shared experts are both quantized (or both left in bf16) decodes one
    token (top-1) as one ``kernels.moe_one_token`` call where it applies; so does an attention
    layer whose four linear layers run through ``kernels.linear``, as one ``kernels.OneTokenAttention``
    call. On one rank, a block whose attention and MoE layers both have such a call decodes one token
    as one ``kernels.one_token_block`` call (norms and residual adds included), and where every block
    does, the model decodes one token through all of them in one ``kernels.run_blocks`` call
    (``_OneTokenBlocks``, the core's ``Transformer.one_token_impl``). A prefill's attention
    runs as ``kernels.prefill_attention`` where it applies (in fp32, where SDPA rounds the softmax
    weights to bf16; ~5x faster than SDPA at 512 tokens on an AMD EPYC Zen 5)."""
    impl = register_attention(kernels.decode_attention, kernels.decode_step)
    layers, moes = {}, {}  # the one-call layers installed below, for the one-call blocks
    for module in model.modules():
        if isinstance(module, Attention):
            module.attend_impl = impl
            module.prefill_attend_impl = kernels.prefill_attention
            module.norm_impl = kernels.rmsnorm
            if all(isinstance(m, (QuantizedLinear, KernelLinear)) for m in (module.wq, module.wk, module.wv, module.wo)):
                layer = kernels.OneTokenAttention(
                    module.wq.weight, module.wk.weight, module.wv.weight, module.wo.weight, module.n_local_heads,
                    module.n_local_kv_heads, module.head_dim, module.norm_eps if module.use_qk_norm else None)
                module.one_token_impl = partial(_attention_one_token, layer=layer, attention=module)
                layers[module] = layer
        elif isinstance(module, RMSNorm):
            module.impl = kernels.rmsnorm
        elif isinstance(module, MoE) and (
            (isinstance(module.experts, QuantizedExperts) and isinstance(module.shared_expert, QuantizedFeedForward))
            or (isinstance(module.experts, KernelExperts) and isinstance(module.shared_expert, KernelFeedForward))):
            routed, shared = module.experts, module.shared_expert
            module.one_token_impl = partial(_moe_one_token, weights=(routed.w1, routed.w3, routed.w2, shared.w1,
                                                                     shared.w3, shared.w2))  # fmt: skip
            moes[module] = module.one_token_impl.keywords["weights"]
    if fs_init.get_model_parallel_world_size() != 1:  # each layer's partial sums are reduced across ranks
        return
    for block in model.layers:
        attention, moe = block.attention, block.feed_forward
        if attention in layers and moe in moes and moe.top_k == 1:
            block.one_token_impl = partial(_block_one_token, block=block, layer=layers[attention], weights=moes[moe])
    if model.layers and all(block.one_token_impl is not None for block in model.layers):
        model.one_token_impl = _OneTokenBlocks([block.one_token_impl for block in model.layers])


def _cache_args(cache) -> tuple:
    """A layer's KV cache as the one-call layers take it: its tensors, chunk, whether a ring."""
    return (*cache.store.tensors(), cache.chunk or 0, isinstance(cache, RingCache))


def _block_args(attention: Attention, moe: MoE, norm1: RMSNorm, norm2: RMSNorm, weights: tuple) -> tuple:
    """A block's KV cache, MoE and norm arguments as ``kernels.one_token_block`` takes them."""
    return (_cache_args(attention.cache), (moe.router_fp32(), *weights),
            (norm1.weight, norm1.eps, norm2.weight, norm2.eps))  # fmt: skip


def _attention_one_token(x_1D: torch.Tensor, position: int, rope, q_scale, layer, attention: Attention):
    return layer(x_1D, position, rope, q_scale, *_cache_args(attention.cache))


def _block_one_token(x_1D: torch.Tensor, positions_bs: torch.Tensor, rope, block: TransformerBlock, layer,
                     weights: tuple) -> Optional[torch.Tensor]:  # fmt: skip
    attention, moe = block.attention, block.feed_forward
    if x_1D.device.type != "cpu":  # as MoE.forward: a GPU would stall on the host-read expert
        return None
    q_scale = attention.temperature(positions_bs)
    return kernels.one_token_block(x_1D, int(positions_bs), rope if attention.use_rope else None,
                                   None if q_scale is None else float(q_scale), layer,
                                   *_block_args(attention, moe, block.attention_norm, block.ffn_norm, weights))


class _OneTokenBlocks:
    """Every block's ``_block_one_token`` (``blocks``: their partials) in one ``kernels.run_blocks``
    call, so that a decode step's Python runs once, not once per block. The plan is made again
    whenever what it was made from changes: the kernels' state (threads, backend, CPU path), a
    layer's KV cache, router or norm weights."""

    def __init__(self, blocks: list):
        # per block: its attention, MoE and two norm modules (held, not looked up each step), the
        # one-call attention layer and the MoE's weights
        self.blocks = []
        for p in blocks:
            b = p.keywords["block"]
            self.blocks.append((b.attention, b.feed_forward, b.attention_norm, b.ffn_norm, p.keywords["layer"],
                                p.keywords["weights"]))  # fmt: skip
        self.kept = None  # (kernels' state, weak references to what the plan was made from, plan)
        self.temperatures: dict = {}  # (floor_scale, attn_scale, (position + 1) // floor_scale) -> temperature

    def __call__(self, x_1D: torch.Tensor, positions_bs: torch.Tensor, rope) -> Optional[torch.Tensor]:
        if x_1D.device.type != "cpu":  # as MoE.forward: a GPU would stall on the host-read expert
            return None
        objs = []
        for attention, moe, norm1, norm2, _, _ in self.blocks:
            cache = attention.cache
            objs += (cache, *cache.store.tensors(), moe.router_fp32(), norm1.weight, norm2.weight)
        state = kernels.block_layer.state()
        kept = self.kept
        # weak references: a plan must not keep replaced KV caches alive (they may be large)
        if kept is None or kept[0] != state or not all(ref() is obj for ref, obj in zip(kept[1], objs)):
            plan = kernels.plan_blocks(x_1D, [self._plan_args(*b) for b in self.blocks])
            kept = self.kept = (state, [weakref.ref(obj) for obj in objs], plan)
        plan = kept[2]
        if plan is None:
            return None
        position = int(positions_bs)
        q_scales = [self._temperature(a, position, positions_bs) if a.temperature_tuning else None
                    for a, *_ in self.blocks]  # fmt: skip
        return kernels.run_blocks(plan, x_1D, position, rope, q_scales)

    def _temperature(self, attention: Attention, position: int, positions_bs: torch.Tensor) -> float:
        """``attention.temperature`` at ``position`` as a float. It changes every floor_scale positions
        only: where floor_scale is a power of two (Llama 4's 8192) and position + 1 <= 2^24, the
        core's fp32 (position + 1) / floor_scale is exact, so its floor is the integer quotient and
        each quotient's value, computed once by the core, holds for all its positions (seven small
        operators a step less: ~0.1 ms of a decode step after the weights swept the caches); elsewhere
        the core's formula runs each time."""
        scale = attention.floor_scale
        power_of_two = scale >= 1 and float(scale).is_integer() and int(scale) & (int(scale) - 1) == 0
        if not (power_of_two and position + 1 <= 1 << 24):
            return float(attention.temperature(positions_bs))
        key = (scale, attention.attn_scale, (position + 1) // int(scale))
        if key not in self.temperatures:
            self.temperatures[key] = float(attention.temperature(positions_bs))
        return self.temperatures[key]

    @staticmethod
    def _plan_args(attention: Attention, moe: MoE, norm1: RMSNorm, norm2: RMSNorm, layer, weights: tuple) -> tuple:
        return (attention.use_rope, layer, *_block_args(attention, moe, norm1, norm2, weights))


def _moe_one_token(x_1D: torch.Tensor, router_ED: torch.Tensor, weights: tuple) -> Optional[torch.Tensor]:
    return kernels.moe_one_token(x_1D, router_ED, *weights)


def convert_to_quantized_model(
    model: Transformer,
    checkpoint: Checkpoint,
    quantization_mode,
    targets=None,
    group_size: int = 128,
    fp8_activation_scale_ub: float = 1200.0,
    nvfp4_activation_amax: Optional[float] = None,
    progress: bool = True,
    prepare: bool = True,
) -> Transformer:
    """Swap targeted modules of a meta-device ``model`` for quantized ones and load all weights.

    Args:
        model: a Transformer built on the meta device.
        checkpoint: the core's view of the checkpoint folder for this rank (its ``device`` and
            ``dtype`` attributes, set by ``Llama4.build``, say where weights go).
        quantization_mode: none, int4_mixed, fp8_mixed, w4a8 or nvfp4.
        targets: which parts to quantize (experts, shared_expert, ffn, attention, output; "all");
            default: the mode's own. A pre-quantized checkpoint brings its own.
        group_size: int4 / w4a8 group size along K.
        fp8_activation_scale_ub: upper bound of fp8 per-token activation scales.
        nvfp4_activation_amax: when set, nvfp4 quantizes activations too, with a static global
            scale of 448 * 6 / this value.
        progress: show a progress bar on rank 0.
        prepare: build the kernels' fast-path forms (off when the weights are only to be saved).
            With it, on a CPU in bf16, the linear layers left in bf16 also run through
            ``kernels.linear`` (see ``KernelLinear``), and on a CPU decode steps attend with
            ``kernels.decode_attention``.
    """
    mode = parse_mode(quantization_mode)
    device = torch.device(getattr(checkpoint, "device", None) or "cpu")
    dtype = getattr(checkpoint, "dtype", torch.bfloat16)
    hf_config = hf_quantization_config(checkpoint.dir)
    source = _Source(checkpoint, mode) if hf_config is None else open_hf_source(checkpoint, mode, hf_config)
    mode = source.mode  # a quantized folder runs in its own mode when none is asked for
    plan = [] if mode == QuantizationMode.none else source.plan(model, targets)
    fmt = MODE_FORMAT.get(mode)
    quantize = partial(quantize_weight, fmt=fmt, group_size=group_size, fp8_activation_scale_ub=fp8_activation_scale_ub,
                       nvfp4_activation_amax=nvfp4_activation_amax)
    world, rank = checkpoint.world_size, checkpoint.rank
    # Weights that will run here on the CPU go into 2 MiB pages (kernels.memory): decode reads them all
    # once per token, and in 4 KiB pages the TLB misses slowed it by a fifth or more. bf16 weights too,
    # copied out of the memory-mapped checkpoint (its page cache lies in 4 KiB pages), except routed
    # experts that _bf16_layers_to_kernels lays out anew anyway.
    placed = huge_page_copy if prepare and device.type == "cpu" else (lambda t, copied=None: t)
    bf16_kernels = prepare and device.type == "cpu" and dtype == torch.bfloat16  # _bf16_layers_to_kernels runs

    def to_device(w: QuantizedWeight) -> QuantizedWeight:
        if isinstance(w, torch.Tensor):  # a weight a quantized folder keeps in bf16 inside a quantized module
            return placed(w.to(device=device, dtype=dtype).contiguous())
        # Contiguous here, so the kernels use these very tensors: quantizing a transposed view
        # yields transposed strides, and a fast path would otherwise keep a second, contiguous copy.
        w = replace(w, **{k: placed(v.to(device).contiguous()) for k, v in tensor_fields(w).items()}, prepared={})
        if prepare:
            kernels.prepare(w, device)
        return w

    def load_quantized(module_path: str, kind: str) -> nn.Module:
        parts = []
        for pname, split, transposed in _weights_of(kind):
            name = f"{module_path}.{pname}"
            w = source.prequantized(name)
            if w is None:
                whole = source.whole(name)
                if transposed:
                    whole = whole.transpose(-1, -2)
                w = quantize(whole.to(torch.bfloat16))
                del whole
            parts.append(to_device(slice_weight(w, split, world, rank)))
        old = model.get_submodule(module_path)
        if kind == "experts":
            assert isinstance(old, Experts)
            return QuantizedExperts(parts[0], parts[1], parts[2])
        if kind == "ffn":
            assert isinstance(old, FeedForward)
            return QuantizedFeedForward(parts[0], parts[1], parts[2], old.do_reduce)
        return QuantizedLinear(parts[0], "row" if kind == "row" else "column", gather_output=(kind == "output"))

    by_layer: dict[str, list[tuple[str, str]]] = {}
    for path, kind in plan:
        key = path.split(".feed_forward")[0].split(".attention")[0] if path.startswith("layers.") else path
        by_layer.setdefault(key, []).append((path, kind))

    bar = _progress(progress and rank == 0, len(model.layers) + 1, mode)
    try:
        units = [f"layers.{i}" for i in range(len(model.layers))] + ["top"]
        for unit in units:
            if bar:
                bar.update(bar.task_ids[0], status=unit)
            replaced = []
            for path, kind in by_layer.get(unit if unit != "top" else "output", []):
                parent, _, attr = path.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, load_quantized(path, kind))
                replaced.append(path + ".")
            prefix = unit + "." if unit != "top" else ""
            for name, param in list(model.named_parameters()):
                in_unit = name.startswith(prefix) if prefix else not name.startswith("layers.")
                if not in_unit or not param.is_meta:
                    continue
                t = source.rank_part(name)
                if tuple(t.shape) != tuple(param.shape):
                    raise CheckpointError(
                        f"tensor {name!r} has shape {tuple(t.shape)} in the checkpoint but the model expects "
                        f"{tuple(param.shape)} (params.json does not match the weights)"
                    )
                out = t.to(device=device, dtype=dtype).contiguous()
                if not (bf16_kernels and isinstance(model.get_submodule(name.rpartition(".")[0]), Experts)):
                    # where out is still a view of the memory-mapped file, its pages go chunk by chunk
                    out = placed(out, copied=lambda start, end: source.release(within=(start, end)))
                if out.data_ptr() == t.data_ptr():  # still a view of the memory-mapped file
                    out = loaded_tensor(name, t, device, dtype)  # (which copies what must not stay one)
                elif t.device.type == "cpu":  # a copy: this process no longer needs the file's pages
                    source.release()
                set_tensor(model, name, out)
            if bf16_kernels:
                _bf16_layers_to_kernels(model, prefix)
            # The bf16 pages this layer was quantized from are not needed again: drop them from this
            # process, so loading holds about one layer of the bf16 checkpoint at a time.
            source.release()
            _return_freed_heap()
            if bar:
                bar.advance(bar.task_ids[0])
    finally:
        if bar:
            bar.stop()
    if prepare and device.type == "cpu":
        _attention_to_kernels(model)
    model.quantization_mode = mode.value
    return model


def _progress(enabled: bool, total: int, mode: QuantizationMode):
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn(f"[bold]loading ({mode.value})"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
        console=Console(stderr=True), transient=True,
    )
    bar.add_task("load", total=total, status="")
    bar.start()
    return bar
