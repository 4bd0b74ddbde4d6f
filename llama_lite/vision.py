"""Llama 4's vision tower for early fusion: a ViT encoder over square tiles, pixel shuffle, the
adapter MLP, and the projection into the text model's embedding space.

The module tree and parameter names are those of Meta's reference (``vision_embeddings.*``,
``vision_projection.weight``); the checkpoint reader maps Hugging Face's names onto them. Tensor
parallel as the reference: attention heads and MLP hidden units are split across ranks, the patch
embedding and the projection gather their outputs, so every rank ends with the whole result.

Shape suffixes: N tiles, L patches per tile (+1 for the class token), C encoder width,
P embeddings per tile after pixel shuffle, D text model width.
"""

import math

import fairscale.nn.model_parallel.initialize as fs_init
import fairscale.nn.model_parallel.layers as fs_layers
import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.mappings import gather_from_model_parallel_region, reduce_from_model_parallel_region
from torch import nn

from .args import VisionArgs
from .errors import ConfigError

# The reference marks the class token's position with this index; it gets no rotation.
_CLS_INDEX = -2


def _keep(w: torch.Tensor) -> torch.Tensor:
    return w


class ColumnLinear(fs_layers.ColumnParallelLinear):
    """Column-parallel x @ w.T + b (this rank's output columns; all of them with ``gather_output``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return gather_from_model_parallel_region(out) if self.gather_output else out


class RowLinear(fs_layers.RowParallelLinear):
    """Row-parallel: partial products summed over ranks, then the (whole, replicated) bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_model_parallel_region(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def column(n_in: int, n_out: int, bias: bool, gather: bool = False) -> ColumnLinear:
    return ColumnLinear(n_in, n_out, bias=bias, gather_output=gather, init_method=_keep)


def row(n_in: int, n_out: int, bias: bool) -> RowLinear:
    return RowLinear(n_in, n_out, bias=bias, input_is_parallel=True, init_method=_keep)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


def rope_2d(args: VisionArgs) -> torch.Tensor:
    """complex64 [L, head_dim/2]: the first half of each head rotates with the patch's column, the
    second half with its row (both counted from 1); the class token, last, is not rotated."""
    side = args.image_size // args.patch_size
    idx = torch.arange(side * side + 1, dtype=torch.int32, device="cpu")
    idx[-1] = _CLS_INDEX
    d = args.dim // args.n_heads // 2
    base = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, device="cpu")[: d // 2].float() / d))
    x = ((idx % side + 1).float()[:, None] * base).repeat_interleave(2, dim=-1)
    y = ((idx // side + 1).float()[:, None] * base).repeat_interleave(2, dim=-1)
    angles = torch.cat([x, y], dim=-1)[:, ::2].masked_fill(idx[:, None] < 0, 0.0)
    return torch.polar(torch.ones_like(angles), angles)


def _rotate(x_NLhd: torch.Tensor, freqs_Ld: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x_NLhd.float().reshape(*x_NLhd.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_Ld[:, None, :]).flatten(3).type_as(x_NLhd)


class Attention(nn.Module):
    """Bidirectional multi-head attention with 2-D rotary positions."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        tp = fs_init.get_model_parallel_world_size()
        if n_heads % tp:
            raise ConfigError(f"the vision encoder's {n_heads} heads do not divide by world size {tp}")
        self.n_local_heads, self.head_dim = n_heads // tp, dim // n_heads
        self.wq = column(dim, dim, bias=True)
        self.wk = column(dim, dim, bias=True)
        self.wv = column(dim, dim, bias=True)
        self.wo = row(dim, dim, bias=True)

    def forward(self, x_NLC: torch.Tensor, freqs_Ld: torch.Tensor) -> torch.Tensor:
        n, length, _ = x_NLC.shape
        shape = (n, length, self.n_local_heads, self.head_dim)
        q = _rotate(self.wq(x_NLC).view(shape), freqs_Ld)
        k = _rotate(self.wk(x_NLC).view(shape), freqs_Ld)
        v = self.wv(x_NLC).view(shape)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(n, length, -1))


class MLP(nn.Module):
    """c_fc -> GELU -> c_proj; the adapter's variant (``act_out``) has no biases and a GELU after c_proj too."""

    def __init__(self, dim: int, hidden: int, out: int, bias: bool, act_out: bool):
        super().__init__()
        self.act_out = act_out
        self.c_fc = column(dim, hidden, bias=bias)
        self.c_proj = row(hidden, out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.c_proj(F.gelu(self.c_fc(x)))
        return F.gelu(out) if self.act_out else out


class EncoderBlock(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.attn = Attention(args.dim, args.n_heads)
        self.ln_1 = LayerNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args.dim, int(args.mlp_ratio * args.dim), args.dim, bias=True, act_out=False)
        self.ln_2 = LayerNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), freqs)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.resblocks = nn.ModuleList(EncoderBlock(args) for _ in range(args.n_layers))


class PatchEmbedding(nn.Module):
    """A stride-p convolution written as unfold + linear, as the reference stores it."""

    def __init__(self, patch_size: int, dim: int):
        super().__init__()
        self.patch_size = patch_size
        self._linear = column(3 * patch_size * patch_size, dim, bias=False, gather=True)

    def forward(self, images_N3HW: torch.Tensor) -> torch.Tensor:
        x = F.unfold(images_N3HW, kernel_size=self.patch_size, stride=self.patch_size)
        return self._linear(x.transpose(1, 2))


class VisionEncoder(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        side = args.image_size // args.patch_size
        self.conv1 = PatchEmbedding(args.patch_size, args.dim)
        self.class_embedding = nn.Parameter(torch.empty(args.dim))
        self.positional_embedding_vlm = nn.Parameter(torch.empty(side * side + 1, args.dim))
        self.ln_pre = LayerNorm(args.dim, args.norm_eps)
        self.ln_post = LayerNorm(args.dim, args.norm_eps)
        self.transformer = Transformer(args)
        self.freqs_cis = rope_2d(args)

    def forward(self, images_N3HW: torch.Tensor) -> torch.Tensor:
        """Encoded patches [N, L-1, C] (the class token, appended last, is dropped at the end)."""
        x = self.conv1(images_N3HW)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([x, cls], dim=1) + self.positional_embedding_vlm.to(x.dtype)
        x = self.ln_pre(x)
        if self.freqs_cis.device != x.device:
            self.freqs_cis = self.freqs_cis.to(x.device)
        for block in self.transformer.resblocks:
            x = block(x, self.freqs_cis)
        return self.ln_post(x)[:, :-1]


def pixel_shuffle(x_NLC: torch.Tensor, ratio: float) -> torch.Tensor:
    """[N, s*s, C] -> [N, s*s*r*r, C/(r*r)]: each group of 1/r x 1/r neighbouring patches becomes one embedding."""
    n, length, c = x_NLC.shape
    side = int(math.isqrt(length))
    x = x_NLC.reshape(n, side, int(side * ratio), int(c / ratio))
    x = x.permute(0, 2, 1, 3).reshape(n, int(side * ratio), int(side * ratio), int(c / ratio**2))
    return x.permute(0, 2, 1, 3).reshape(n, -1, int(c / ratio**2))


class VisionAdapter(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.ratio = args.pixel_shuffle_ratio
        self.mlp = MLP(int(args.dim / self.ratio**2), args.output_dim, args.output_dim, bias=False, act_out=True)

    def forward(self, x_NLC: torch.Tensor) -> torch.Tensor:
        return self.mlp(pixel_shuffle(x_NLC, self.ratio))


class VisionEmbeddings(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.vision_encoder = VisionEncoder(args)
        self.vision_adapter = VisionAdapter(args)

    def forward(self, tiles_N3HW: torch.Tensor) -> torch.Tensor:
        """Adapter outputs [N, P, output_dim] for each tile."""
        return self.vision_adapter(self.vision_encoder(tiles_N3HW))


def vision_modules(args: VisionArgs, text_dim: int) -> tuple[VisionEmbeddings, ColumnLinear]:
    """The tower and its projection into the text model (``vision_embeddings``, ``vision_projection``)."""
    tp = fs_init.get_model_parallel_world_size()
    for what, n in (("width", args.dim), ("MLP width", int(args.mlp_ratio * args.dim)),
                    ("output_dim", args.output_dim), ("text model width", text_dim)):
        if n % tp:
            raise ConfigError(f"the vision tower's {what} {n} does not divide by world size {tp}")
    saved = fs_layers._initialize_affine_weight
    # Weights always come from a checkpoint: skip fairscale's initialisation at construction.
    fs_layers._initialize_affine_weight = lambda *a, **k: None
    try:
        return VisionEmbeddings(args), column(args.output_dim, text_dim, bias=False, gather=True)
    finally:
        fs_layers._initialize_affine_weight = saved


def encode_images(embeddings: VisionEmbeddings, projection: ColumnLinear, tiles_N3HW: torch.Tensor) -> torch.Tensor:
    """Patch embeddings in the text model's space, [N * P, D], in the order of the ``<|patch|>`` tokens."""
    dtype = projection.weight.dtype
    out = projection(embeddings(tiles_N3HW.to(device=projection.weight.device, dtype=dtype)))
    return out.reshape(-1, out.shape[-1])
