"""Llama 4 text transformer: GQA attention with iRoPE (chunked local RoPE layers, global NoPE
layers), a sparse mixture of experts with a shared expert, and a KV cache with per-row positions.

Shape suffixes follow Meta's reference where shapes are the point:
B batch, S new tokens, L cached length, D model dim, E experts, F expert hidden (per rank),
a = B*S tokens, T = tokens routed (a * top_k).
"""

import contextlib
import math
from typing import Callable, Optional, Union

import fairscale.nn.model_parallel.initialize as fs_init
import fairscale.nn.model_parallel.layers as fs_layers
import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import VocabParallelEmbedding
from fairscale.nn.model_parallel.mappings import gather_from_model_parallel_region, reduce_from_model_parallel_region
from torch import nn

from .args import ModelArgs
from .errors import ConfigError
from .kv_cache import Step, make_cache
from .vision import encode_images, vision_modules


def rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def linear(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """x @ w.T, in the forms that read the weight at memory speed on CPUs (measured on AVX-512/AMX).

    One row (decode at batch 1): ``torch.mv``, whose bf16 kernel streams the weight once.
    More rows: (w @ x.T).T -- with the weight as the left operand oneDNN reads it in place, while
    as the right operand (F.linear) it is copied into a blocked layout on every call, which cost
    ~25% at decode and ~40% in prefill GEMMs on AMX Xeons. (Not on every CPU: on an AMD EPYC Zen 5
    F.linear was 1.1-1.6x faster, with the same bits.)
    """
    x_MK = x.reshape(-1, x.shape[-1])
    if x_MK.shape[0] == 1:
        out = torch.mv(w_NK, x_MK[0])
    else:
        out = (w_NK @ x_MK.T).T.contiguous()
    return out.view(*x.shape[:-1], w_NK.shape[0])


def reduce_parallel(x: torch.Tensor) -> torch.Tensor:
    """Sum of the ranks' partial results (fairscale's all-reduce); the tensor itself on one rank,
    without the ~50 us that fairscale's autograd function costs per call even then."""
    return x if fs_init.get_model_parallel_world_size() == 1 else reduce_from_model_parallel_region(x)


def gather_parallel(x: torch.Tensor) -> torch.Tensor:
    """The ranks' column shards joined along the last dimension; the tensor itself on one rank."""
    return x if fs_init.get_model_parallel_world_size() == 1 else gather_from_model_parallel_region(x)


class ColumnParallelLinear(fs_layers.ColumnParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight)  # fairscale's copy_to_model_parallel_region is the identity in forward
        return gather_parallel(out) if self.gather_output else out


class RowParallelLinear(fs_layers.RowParallelLinear):
    """Always ``input_is_parallel=True`` here: the input arrives sharded from a column-parallel layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_parallel(linear(x, self.weight))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # impl(x, weight, eps) -> the same values in one call, or None where it does not apply;
        # a loader may install one (eager code only: compiled code fuses these operators itself)
        self.impl: Optional[Callable] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm_via(self.impl, x, self.weight, self.eps)


def rmsnorm_via(impl: Optional[Callable], x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """``rmsnorm(x, eps)`` (times ``weight`` if given), by ``impl(x, weight, eps)`` where one is
    installed and does not decline (None); compiled code always takes the operators, which it fuses."""
    out = impl(x, weight, eps) if impl is not None and not torch.compiler.is_compiling() else None
    if out is None:
        out = rmsnorm(x, eps) if weight is None else rmsnorm(x, eps) * weight
    return out


def rope_at(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), fp32 [*positions.shape, 1, head_dim], of the angles pos * freq for the frequencies
    of ``rope_inverse_frequencies``, laid out for ``apply_rope``: each pair's angle at both of its
    members, the sine negated at the first.

    Computed per call rather than looked up in a max_seq_len table, which at a long context would
    take gigabytes (the values are the same: one fp32 product per entry either way).
    """
    angles = positions.to(torch.float32).unsqueeze(-1) * freqs.to(positions.device)
    cos, sin = torch.cos(angles), torch.sin(angles)
    cos2 = torch.stack((cos, cos), dim=-1).flatten(-2)
    sin2 = torch.stack((-sin, sin), dim=-1).flatten(-2)
    return cos2.unsqueeze(-2), sin2.unsqueeze(-2)


def rope_inverse_frequencies(args: ModelArgs) -> torch.Tensor:
    """fp32 [head_dim/2]: the rotation per position of each pair, with Llama 4's low/high frequency scaling."""
    dim = args.head_dim
    # Always computed on the CPU in fp32, also while the model itself is built on the meta device.
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, device="cpu")[: dim // 2].float() / dim))
    if args.use_scaled_rope:
        old_context, low_factor, high_factor = 8192, 1.0, args.rope_high_freq_factor
        wavelen = 2 * math.pi / freqs
        smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor) if high_factor != low_factor else 0
        scaled = (1 - smooth) * freqs / args.rope_scaling_factor + smooth * freqs
        freqs = torch.where(
            wavelen < old_context / high_factor,
            freqs,
            torch.where(wavelen > old_context / low_factor, freqs / args.rope_scaling_factor, scaled),
        )
    return freqs


def apply_rope(x_bshd: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Interleaved (complex-pair) rotary embedding, as Meta's reference: each pair (a, b) of the
    head dimension turns by its angle, (a cos - b sin, a sin + b cos), in fp32. Real arithmetic
    (not complex tensors), which compiled code fuses, as x * cos + swap(x) * sin with the layout of
    ``rope_at`` (swap: (b, a) per pair): the same products and sums, so the same bits, in half
    the eager ops of splitting the pairs."""
    cos, sin = rope
    xf = x_bshd.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xf * cos + swapped * sin).type_as(x_bshd)


def attention_masks(positions_bs: torch.Tensor, cache_len: int, chunk: Optional[int]):
    """Boolean masks [B, 1, S, L] (True = may attend): causal, and causal within the query's chunk."""
    key_pos = torch.arange(cache_len, device=positions_bs.device)
    q = positions_bs.unsqueeze(-1)
    causal = key_pos <= q
    local = causal & (key_pos // chunk == q // chunk) if chunk else causal
    return causal.unsqueeze(1), local.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, use_rope: bool, use_qk_norm: bool):
        super().__init__()
        tp = fs_init.get_model_parallel_world_size()
        if args.n_kv_heads % tp or args.n_heads % tp:
            raise ConfigError(f"n_heads ({args.n_heads}) and n_kv_heads ({args.n_kv_heads}) must divide by world size {tp}")
        self.use_rope, self.use_qk_norm = use_rope, use_qk_norm
        self.temperature_tuning = args.attn_temperature_tuning and not use_rope
        self.floor_scale, self.attn_scale, self.norm_eps = args.floor_scale, args.attn_scale, args.norm_eps
        self.head_dim = args.head_dim
        self.n_local_heads = args.n_heads // tp
        self.n_local_kv_heads = args.n_kv_heads // tp
        hd = self.head_dim
        self.wq = ColumnParallelLinear(args.dim, args.n_heads * hd, bias=False, gather_output=False, init_method=_keep)
        self.wk = ColumnParallelLinear(args.dim, args.n_kv_heads * hd, bias=False, gather_output=False, init_method=_keep)
        self.wv = ColumnParallelLinear(args.dim, args.n_kv_heads * hd, bias=False, gather_output=False, init_method=_keep)
        self.wo = RowParallelLinear(args.n_heads * hd, args.dim, bias=False, input_is_parallel=True, init_method=_keep)
        self.chunk = args.attention_chunk_size if use_rope else None
        self.cache = None  # a kv_cache.RingCache (chunked layers) or PrefixCache
        self.attend_impl = 0  # the decode step's attention over the cache (kv_cache.register_attention); 0: SDPA
        self.norm_impl: Optional[Callable] = None  # the heads' RMSNorm in one call, as RMSNorm.impl (weight None)
        # one_token_impl(x_1D, position, rope, q_scale) -> wo's output [1, D] for one token (batch-1
        # decode) in one call, or None where it does not apply: rope the (cos, sin) of the position
        # (None without RoPE), q_scale the temperature as a float (None: none). It reads and writes
        # ``self.cache`` itself. A loader may install one (eager code only).
        self.one_token_impl: Optional[Callable] = None
        # prefill_attend_impl(q, keys, values, mask) -> [B, S, H, D], or None where it does not
        # apply: a prefill's attention (q [B, S, H, D], keys / values [B, L, Hkv, D] as the cache
        # returns them, mask [B, 1, S, L] True = may attend) in place of SDPA. A loader may install one.
        self.prefill_attend_impl: Optional[Callable] = None

    @property
    def cache_k(self) -> Optional[torch.Tensor]:
        return None if self.cache is None else self.cache.store.k

    @property
    def cache_v(self) -> Optional[torch.Tensor]:
        return None if self.cache is None else self.cache.store.v

    def setup_cache(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype, device, layout="by_kind") -> None:
        self.cache = make_cache(layout, self.chunk, max_batch_size, max_seq_len, self.n_local_kv_heads,
                                self.head_dim, dtype, device)

    def temperature(self, positions_bs: torch.Tensor) -> Optional[torch.Tensor]:
        """The factor [B, S] (fp32) that sharpens attention at long range on the global (NoPE)
        layers (1 below floor_scale); None on the other layers."""
        if not self.temperature_tuning:
            return None
        pos = positions_bs.float()
        return torch.log(torch.floor((pos + 1.0) / self.floor_scale) + 1.0) * self.attn_scale + 1.0

    def forward(self, x_bsD, positions_bs, rope, step: Optional[Step]) -> torch.Tensor:
        """``step`` None: decode, one token per row (``positions_bs`` [B, 1]), with fixed shapes
        around the cache (``decode_attention``)."""
        bsz, seqlen, _ = x_bsD.shape
        q_scale = self.temperature(positions_bs)
        if step is None and bsz == 1 and self.one_token_impl is not None and not torch.compiler.is_compiling():
            out = self.one_token_impl(x_bsD.view(1, -1), int(positions_bs), rope if self.use_rope else None,
                                      None if q_scale is None else float(q_scale))  # fmt: skip
            if out is not None:
                return reduce_parallel(out.view(bsz, seqlen, -1))
        q = self.wq(x_bsD).view(bsz, seqlen, self.n_local_heads, self.head_dim)
        k = self.wk(x_bsD).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        v = self.wv(x_bsD).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        if self.use_rope or self.use_qk_norm:  # per head: q's and k's heads as one tensor, half the ops
            qk = torch.cat((q, k), dim=2)
            if self.use_rope:
                qk = apply_rope(qk, rope)
            if self.use_qk_norm:
                qk = rmsnorm_via(self.norm_impl, qk, None, self.norm_eps)
            q, k = qk.split((self.n_local_heads, self.n_local_kv_heads), dim=2)
        if q_scale is not None:
            q = (q * q_scale[:, :, None, None]).type_as(k)

        if step is None:
            out = self.cache.decode(q, k, v, positions_bs[:, 0], self.attend_impl)
            return self.wo(out.reshape(bsz, seqlen, -1))
        # Each row writes its own positions, so rows of different lengths share one cache.
        keys, values, mask_b1sl = self.cache.update(k, v, step)
        out = None
        if self.prefill_attend_impl is not None and not torch.compiler.is_compiling():
            out = self.prefill_attend_impl(q, keys, values, mask_b1sl)
        if out is None:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                 attn_mask=mask_b1sl, enable_gqa=True).transpose(1, 2)
        return self.wo(out.reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU. As a shared expert (do_reduce=False) its partial sums join the routed ones before one reduction."""

    def __init__(self, dim: int, hidden_dim: int, do_reduce: bool = True):
        super().__init__()
        self.do_reduce = do_reduce
        self.w1 = ColumnParallelLinear(dim, hidden_dim, bias=False, gather_output=False, init_method=_keep)
        self.w3 = ColumnParallelLinear(dim, hidden_dim, bias=False, gather_output=False, init_method=_keep)
        self.w2 = RowParallelLinear(hidden_dim, dim, bias=False, input_is_parallel=True, init_method=_keep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(F.silu(linear(x, self.w1.weight)) * linear(x, self.w3.weight), self.w2.weight)
        return reduce_parallel(out) if self.do_reduce else out


def each_expert(x_TD: torch.Tensor, offsets_E1: torch.Tensor, ffn: Callable[[int, torch.Tensor], torch.Tensor]):
    """Rows offsets[e]:offsets[e+1] of x_TD through ``ffn(e, rows)``, for each expert e with rows."""
    out_TD = torch.empty_like(x_TD)
    bounds = offsets_E1.tolist()
    for e in range(offsets_E1.numel() - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if lo < hi:
            out_TD[lo:hi] = ffn(e, x_TD[lo:hi])
    return out_TD


def routed_experts_eager(x_TD: torch.Tensor, offsets_E1: torch.Tensor, w1_EDF: torch.Tensor, w3_EDF: torch.Tensor,
                         w2_EFD: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert e on rows offsets[e]:offsets[e+1] of x_TD (weights as Meta stores them)."""
    return each_expert(x_TD, offsets_E1, lambda e, x: linear(
        F.silu(linear(x, w1_EDF[e].mT)) * linear(x, w3_EDF[e].mT), w2_EFD[e].mT))


# Reads the offsets on the host: CUDA graphs leave it out (inductor splits the graph around it).
routed_experts = torch.library.custom_op("llama_lite::routed_experts", routed_experts_eager, mutates_args=(),
                                         tags=(torch.Tag.cudagraph_unsafe,))


@routed_experts.register_fake
def _(x_TD, offsets_E1, w1_EDF, w3_EDF, w2_EFD):
    return torch.empty_like(x_TD)


class Experts(nn.Module):
    """Routed experts, sharded along the hidden dimension. Weights as Meta stores them: w1/w3 [E, D, F], w2 [E, F, D].

    ``use_linear_layout`` keeps those shapes but stores each expert's matrix transposed in memory
    (as ``nn.Linear`` does): every matmul then reads its weight row by row, which is what fast
    GEMV kernels want (2x at decode on CPUs).
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        tp = fs_init.get_model_parallel_world_size()
        if hidden_dim % tp:
            raise ConfigError(f"expert hidden size {hidden_dim} does not divide by world size {tp}")
        f = hidden_dim // tp
        self.num_experts, self.dim = num_experts, dim
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, f))
        self.w2 = nn.Parameter(torch.empty(num_experts, f, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, f))

    def forward(self, x_TD: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
        """x_TD: tokens sorted by expert; rows offsets[e]:offsets[e+1] go to expert e."""
        if torch.compiler.is_compiling():  # the loop's bounds are data: one opaque operator in a graph
            return routed_experts(x_TD, offsets_E1, self.w1, self.w3, self.w2)
        return routed_experts_eager(x_TD, offsets_E1, self.w1, self.w3, self.w2)

    @torch.no_grad()
    def use_linear_layout(self) -> None:
        """Store w1/w2/w3 as [E, F, D] / [E, D, F] in memory (same shapes, transposed strides), one at a time."""
        for name in ("w1", "w2", "w3"):
            w = getattr(self, name)
            if w.is_meta or w.mT.is_contiguous():
                continue
            t = torch.empty(w.shape[0], w.shape[2], w.shape[1], dtype=w.dtype, device=w.device)
            for e in range(w.shape[0]):
                t[e].copy_(w[e].T)  # 2-D transposed copies take torch's blocked path: 3x faster than 3-D ones
            setattr(self, name, nn.Parameter(t.mT, requires_grad=False))
            del w


class MoE(nn.Module):
    """Top-k sigmoid router; each token visits only its selected experts (sparse dispatch), plus the shared expert."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        assert args.moe_args is not None
        self.top_k = args.moe_args.top_k
        hidden = args.expert_hidden_dim()
        self.experts = Experts(args.moe_args.num_experts, args.dim, hidden)
        self.router_DE = nn.Parameter(torch.empty(args.dim, args.moe_args.num_experts))
        self._router_key, self._router_ED = None, None  # router_logits' fp32 copy and what it was made from
        self._one_token_offsets: dict = {}  # (expert, device) -> offsets [E + 1] of one row routed there
        # one_token_impl(x_1D, router_ED) -> ``_one_token``'s result in one call, or None where it does
        # not apply (router_ED: ``router_fp32``); a loader may install one (eager code only)
        self.one_token_impl: Optional[Callable] = None
        self.shared_expert = FeedForward(args.dim, hidden, do_reduce=False)

    def router_logits(self, x_aD: torch.Tensor) -> torch.Tensor:
        """x @ router_DE, in x's dtype: products summed in fp32, rounded once (as a bf16 matmul does).

        Computed as an fp32 matrix-vector product on a cached fp32 copy of the router ([E, D], a
        few hundred KiB): oneDNN's bf16 matmul of one row by this [D, E] matrix took ~100 us right
        after a GEMV had streamed its weights (in a decode step, on an AMX Xeon), the fp32 product
        ~20 us. The copy follows the weight: it is rebuilt when the weight is replaced or written.
        Other devices keep the bf16 matmul; compiled code converts in the graph.
        """
        w = self.router_DE
        if x_aD.device.type != "cpu":
            return x_aD @ w
        if torch.compiler.is_compiling():
            return (x_aD.float() @ w.float()).to(x_aD.dtype)
        router_ED = self.router_fp32()
        if x_aD.shape[0] == 1:
            return torch.mv(router_ED, x_aD[0].float()).to(x_aD.dtype)[None]
        return (x_aD.float() @ router_ED.t()).to(x_aD.dtype)

    def router_fp32(self) -> torch.Tensor:
        """The router as a contiguous fp32 [E, D] copy, rebuilt when the weight is replaced or written."""
        w = self.router_DE
        key = (w.data_ptr(), w._version, w.dtype, tuple(w.shape))
        if self._router_key != key:
            self._router_ED = w.detach().t().float().contiguous()
            self._router_key = key
        return self._router_ED

    def route(self, x_aD: torch.Tensor):
        """Returns (token index per routed row, score per routed row, offsets [E+1]), rows sorted by expert."""
        scores_aK, experts_aK = torch.topk(self.router_logits(x_aD), self.top_k, dim=-1)
        scores_aK = torch.sigmoid(scores_aK)
        experts_T = experts_aK.flatten()
        order_T = torch.argsort(experts_T, stable=True)
        # offsets[e] = routed rows with an expert below e, found in the sorted experts (a fixed
        # [E + 1] shape, unlike bincount's)
        bounds = torch.arange(self.router_DE.shape[1] + 1, device=x_aD.device)
        offsets = torch.searchsorted(experts_T[order_T], bounds)
        return order_T // self.top_k, scores_aK.flatten()[order_T], offsets

    def route_one(self, x_1D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``route`` for one token with top-1 routing: (its score [1, 1], offsets [E + 1]). Its
        expert is read on the host and the offsets are kept per expert: none of the sort, search
        and index ops that route many tokens."""
        score_11, expert_11 = torch.topk(self.router_logits(x_1D), 1, dim=-1)
        key = (int(expert_11), x_1D.device)
        offsets = self._one_token_offsets.get(key)
        if offsets is None:
            bounds = torch.arange(self.router_DE.shape[1] + 1, device=x_1D.device)
            offsets = self._one_token_offsets[key] = (bounds > key[0]).to(torch.long)
        return torch.sigmoid(score_11), offsets

    def _one_token(self, x_1D: torch.Tensor) -> torch.Tensor:
        """``forward`` of one token with top-1 routing (decode at batch 1): the same operations on
        the same values as the general route, ~15 fewer ops per layer."""
        if self.one_token_impl is not None:
            out_1D = self.one_token_impl(x_1D, self.router_fp32())
            if out_1D is not None:
                return out_1D
        score_11, offsets = self.route_one(x_1D)
        routed_1D = self.experts(x_1D * score_11, offsets)
        out_1D = self.shared_expert(x_1D)
        out_1D += routed_1D
        return out_1D

    def forward(self, x_bsD: torch.Tensor) -> torch.Tensor:
        shape = x_bsD.shape
        x_aD = x_bsD.reshape(-1, shape[-1])
        # on a CPU: reading the expert on the host would stall a GPU's stream every layer
        if x_aD.shape[0] == 1 and self.top_k == 1 and x_aD.device.type == "cpu" and not torch.compiler.is_compiling():
            return reduce_parallel(self._one_token(x_aD)).view(shape)
        token_T, score_T, offsets = self.route(x_aD)
        routed_TD = self.experts(x_aD[token_T] * score_T.unsqueeze(-1), offsets)
        out_aD = self.shared_expert(x_aD)
        if self.top_k == 1:  # token_T is a permutation: a permuted add, which (unlike index_add_) runs in parallel
            out_aD[token_T] += routed_TD
        else:
            out_aD.index_add_(0, token_T, routed_TD)
        return reduce_parallel(out_aD).view(shape)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.is_nope_layer = args.is_nope_layer(layer_id)
        self.attention = Attention(
            args, use_rope=not self.is_nope_layer, use_qk_norm=args.use_qk_norm and not self.is_nope_layer
        )
        self.feed_forward = MoE(args) if args.is_moe_layer(layer_id) else FeedForward(args.dim, args.dense_hidden_dim())
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        # one_token_impl(x_1D, positions_bs, rope) -> the block's output [1, D] for one token (batch-1
        # decode) in one call, or None where it does not apply; a loader may install one (eager only)
        self.one_token_impl: Optional[Callable] = None

    def forward(self, x, positions, rope, step: Optional[Step]):
        """``step`` None: a decode step (see ``Attention.forward``)."""
        if step is None and self.one_token_impl is not None and x.shape[:2] == (1, 1) and not torch.compiler.is_compiling():
            out = self.one_token_impl(x.view(1, -1), positions, rope)
            if out is not None:
                return out.view(x.shape)
        h = x + self.attention(self.attention_norm(x), positions, rope, step)
        return h + self.feed_forward(self.ffn_norm(h))


def _keep(w: torch.Tensor) -> torch.Tensor:
    return w


@contextlib.contextmanager
def _no_weight_init():
    """fairscale's layers fill weights at construction; weights always come from a checkpoint, so skip it."""
    saved = fs_layers._initialize_affine_weight
    fs_layers._initialize_affine_weight = lambda *args, **kwargs: None
    try:
        yield
    finally:
        fs_layers._initialize_affine_weight = saved


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_size, self.n_layers = args.vocab_size, args.n_layers
        with _no_weight_init():
            self.tok_embeddings = VocabParallelEmbedding(args.vocab_size, args.dim, init_method=_keep)
            self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
            self.norm = RMSNorm(args.dim, eps=args.norm_eps)
            self.output = ColumnParallelLinear(args.dim, args.vocab_size, bias=False, init_method=_keep)
        self.rope_freqs = rope_inverse_frequencies(args)
        self._decode_compiled = None  # see compile_decode
        # one_token_impl(h_1D, positions_bs, rope) -> the last layer's output [1, D] for one token
        # (batch-1 decode) through every layer in one call, or None where it does not apply (each
        # layer then runs as its own forward). A loader may install one (eager code only).
        self.one_token_impl: Optional[Callable] = None
        if args.vision_args is not None:
            self.vision_embeddings, self.vision_projection = vision_modules(args.vision_args, args.dim)

    def encode_images(self, tiles: torch.Tensor) -> torch.Tensor:
        """Patch embeddings [N * P, D] of image tiles [N, 3, H, W] (preprocessed), for ``forward``'s ``image_embeddings``."""
        if self.args.vision_args is None:
            raise ConfigError("this model has no vision tower (its config has no vision_args / vision_config)")
        return encode_images(self.vision_embeddings, self.vision_projection, tiles)

    def use_linear_layout(self) -> None:
        """Lay routed experts out for fast matmuls (see ``Experts.use_linear_layout``); call once weights are loaded."""
        for module in self.modules():
            if isinstance(module, Experts):
                module.use_linear_layout()

    def compile_decode(self, mode: Optional[str] = None) -> None:
        """torch.compile the decode step (one token per row): one graph from the embeddings to the
        logits, with the kernels and the KV cache's attention as opaque operators, so that norms,
        RoPE, routing and residuals fuse and no Python runs between them. Prefill stays eager.
        ``mode``: torch.compile's (None: inductor's default; "reduce-overhead": CUDA graphs).
        Graphs are made on first use: one for batch 1 and one for any larger batch (the batch
        dimension turns dynamic on the first change); positions are tensors, so never recompile."""
        # emulate_precision_casts: fused code rounds to bf16 wherever eager code does, so compiled
        # and eager decode give the same numbers (inductor otherwise keeps fused bf16 math in fp32)
        # torch.compile takes a mode or options, not both: the mode's options join ours
        options = {"emulate_precision_casts": True}
        if mode is not None:
            options.update(torch._inductor.list_mode_options(mode))
        self._decode_compiled = torch.compile(self._decode, fullgraph=True, options=options)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if fs_init.get_model_parallel_world_size() == 1:  # fairscale's layer adds two no-op autograd functions
            return F.embedding(tokens, self.tok_embeddings.weight)
        return self.tok_embeddings(tokens)

    def _decode(self, tokens_b1: torch.Tensor, positions_b1: torch.Tensor) -> torch.Tensor:
        rope = rope_at(self.rope_freqs, positions_b1)
        h = self._embed(tokens_b1)
        out = None
        if tokens_b1.shape[0] == 1 and self.one_token_impl is not None and not torch.compiler.is_compiling():
            out = self.one_token_impl(h.view(1, -1), positions_b1, rope)
        if out is not None:
            h = out.view_as(h)
        else:
            for layer in self.layers:
                h = layer(h, positions_b1, rope, None)
        return self.output(self.norm(h)).float()

    def setup_caches(self, dtype: Optional[torch.dtype] = None, device=None, layout: str = "by_kind") -> None:
        """KV caches of every layer, stored in ``dtype`` (default: the weights'; ``torch.float8_e4m3fn``
        stores fp8 with per-token-and-head scales). ``layout`` "by_kind": a ring of one chunk on
        chunked layers, max_seq_len on global ones; "full": max_seq_len everywhere."""
        dtype = dtype or self.norm.weight.dtype
        device = device or self.norm.weight.device
        for layer in self.layers:
            layer.attention.setup_cache(self.args.max_batch_size, self.args.max_seq_len, dtype, device, layout)

    def kv_cache_bytes(self) -> int:
        return sum(layer.attention.cache.store.nbytes() for layer in self.layers if layer.attention.cache is not None)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: Union[int, torch.Tensor] = 0,
        last_index: Optional[torch.Tensor] = None,
        lengths: Optional[torch.Tensor] = None,
        image_embeddings: Optional[torch.Tensor] = None,
        image_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits (float32) for tokens [B, S] written at positions start_pos (+ 0..S-1) of each row.

        ``start_pos`` is an int or a LongTensor [B] (rows at different positions); each row's cache
        must hold its positions before start_pos. With ``last_index`` [B], only the logits at that
        index of each row are computed: [B, 1, V]. ``lengths`` [B]: the real tokens of each row;
        the rest pads it and is not stored in the cache (its logits are meaningless). Rows of
        different lengths must say so: stored padding would overwrite a chunked layer's ring.
        Early fusion: ``image_embeddings`` [n, D] (from ``encode_images``) replace, in order, the
        embeddings of the n tokens where ``image_mask`` [B, S] is True (the ``<|patch|>`` tokens).
        """
        bsz, seqlen = tokens.shape
        device = tokens.device
        if not torch.is_tensor(start_pos):
            start_pos = torch.full((bsz,), int(start_pos), dtype=torch.long, device=device)
        positions = start_pos.to(device).view(bsz, 1) + torch.arange(seqlen, device=device)
        end = int(positions.max()) + 1
        if bsz > self.args.max_batch_size or end > self.args.max_seq_len:
            raise ValueError(
                f"batch {bsz} x length {end} exceeds the cache ({self.args.max_batch_size} x {self.args.max_seq_len})"
            )
        if self.layers[0].attention.cache is None:
            self.setup_caches()
        if seqlen == 1 and lengths is None and image_embeddings is None:  # decode: fixed shapes
            if self._decode_compiled is not None and bsz > 1:  # one graph for every batch above 1
                torch._dynamo.maybe_mark_dynamic(tokens, 0)
                torch._dynamo.maybe_mark_dynamic(positions, 0)
            return (self._decode_compiled or self._decode)(tokens, positions)
        step = Step(positions, None if lengths is None else lengths.to(device))
        rope = rope_at(self.rope_freqs, positions)
        h = self._embed(tokens)
        if image_embeddings is not None:
            h = h.masked_scatter(image_mask.to(device).unsqueeze(-1), image_embeddings.to(h.dtype))
        for layer in self.layers:
            h = layer(h, positions, rope, step)
        if last_index is not None:
            h = h[torch.arange(bsz, device=device), last_index.to(device)].unsqueeze(1)
        return self.output(self.norm(h)).float()
