"""Quantization quality: perplexity over a text file and, against a bf16 base, KL divergence and
top-1 agreement of the next-token distributions (as llama.cpp's perplexity tool with --kl-divergence).

    python -m scripts.perplexity CKPT --text wiki.txt --quantization_mode all
    python -m scripts.perplexity CKPT-W4A16,CKPT-FP8 --text wiki.txt --base CKPT

The text is cut into windows of --ctx tokens (each begins with the begin-of-text token); the second
half of each window is scored, so every scored token sees at least ctx/2 tokens of context. The
base's log-probabilities are kept on disk between models, so memory holds one model at a time.
"""

import gc
import math
import tempfile
from pathlib import Path
from typing import Optional

import torch

from llama_lite.generation import find_tokenizer
from scripts.common import (
    QUANTIZATION_MODES,
    FlagError,
    build_llama,
    check_quantization_mode,
    is_main,
    parse_dtype,
    path_flag,
    run_cli,
    set_kernels,
    text_flag,
    with_flag_help,
)


def stored_mode(ckpt: Path) -> Optional[str]:
    """The mode a pre-quantized folder runs in ("none": a Hugging Face quantized folder picks its own),
    or None for bf16 weights."""
    from quantization.checkpoint_io import read_quant_config
    from quantization.sources import hf_quantization_config

    ours = read_quant_config(ckpt)
    if ours is not None:
        return ours["quantization_mode"]
    return "none" if hf_quantization_config(ckpt) is not None else None


def is_prequantized(ckpt: Path) -> bool:
    return stored_mode(ckpt) is not None


def windows(tokens: list[int], ctx: int, bos: int, chunks: Optional[int]) -> list[torch.Tensor]:
    n = len(tokens) // ctx
    if chunks is not None:
        n = min(n, chunks)
    if n == 0:
        raise FlagError(f"the text has {len(tokens)} tokens, fewer than one window of --ctx {ctx}")
    out = []
    for i in range(n):
        w = torch.tensor(tokens[i * ctx : (i + 1) * ctx])
        w[0] = bos
        out.append(w)
    return out


def score(llama, wins: list[torch.Tensor], store: Path, base: Optional[Path]) -> dict:
    """NLL per scored token, and against the base's stored log-probabilities KL divergence and top-1."""
    nll, kld, same = [], [], []
    device = llama.device
    for i, w in enumerate(wins):
        first = len(w) // 2
        with torch.no_grad():
            logits = llama.model(w[None].to(device), 0)[0, first:-1].float().cpu()
        lp = torch.log_softmax(logits, dim=-1)
        del logits
        nll.append(-lp.gather(-1, w[first + 1 :, None]).squeeze(-1))
        if base is not None:
            lp_base = torch.load(base / f"{i}.pt", weights_only=True)
            kld.append((lp_base.exp() * (lp_base - lp)).sum(-1).clamp(min=0))
            same.append(lp_base.argmax(-1) == lp.argmax(-1))
        else:
            torch.save(lp, store / f"{i}.pt")
    nll = torch.cat(nll)
    res = {"ppl": math.exp(nll.double().mean().item()), "tokens": nll.numel()}
    if base is not None:
        k = torch.cat(kld).double()
        res.update(kld_mean=k.mean().item(), kld_p99=torch.quantile(k, 0.99).item(),
                   top1=torch.cat(same).double().mean().item())
    return res


@with_flag_help
def main(
    checkpoint_dirs: str,
    text: Optional[str] = None,
    quantization_mode: Optional[str] = None,
    base: Optional[str] = None,
    ctx: int = 512,
    chunks: Optional[int] = None,
    world_size: Optional[int] = None,
    dtype: str = "bf16",
    kernels: str = "auto",
) -> None:
    """Print perplexity (and, against a bf16 base, mean / 99th-percentile KL divergence and top-1
    agreement) for each checkpoint and mode, as one Markdown table.

    Args:
        checkpoint_dirs: Checkpoint folder(s), comma-separated: bf16 ones (Meta or Hugging Face layout),
            llama-lite's pre-quantized ones, or Hugging Face quantized ones (compressed-tensors, fbgemm_fp8).
        text: A UTF-8 text file to score (required).
        quantization_mode: Mode(s) each bf16 checkpoint is loaded in, comma-separated, or "all" (none and
            every quantization mode); default none. A pre-quantized folder always runs in its own mode.
        base: The bf16 checkpoint the KL divergence and top-1 agreement are measured against (run in
            mode none). By default the first bf16 checkpoint of checkpoint_dirs; without one, no KL divergence.
        ctx: Tokens per window; the second half of each window is scored.
        chunks: Score at most this many windows (default: every whole window of the text).
        {world_size}
        {dtype}
        {kernels}
    """
    text = text_flag("text", text)
    if text is None:
        raise FlagError("--text is required: give a text file to score")
    path = path_flag("text", text)
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FlagError(f"cannot read --text {path}: {e}") from None
    if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 4:
        raise FlagError(f"--ctx must be an integer >= 4, got {ctx!r}")
    if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise FlagError(f"--chunks must be a positive integer, got {chunks!r}")
    ckpts = [path_flag("checkpoint_dirs", c) for c in str(checkpoint_dirs).split(",") if c.strip()]
    if not ckpts:
        raise FlagError("checkpoint_dirs is required")
    if quantization_mode in (None, "None"):
        modes = ["none"]
    elif quantization_mode == "all":
        modes = list(QUANTIZATION_MODES)
    else:
        modes = [check_quantization_mode(m.strip()) for m in str(quantization_mode).split(",") if m.strip()]
    set_kernels(kernels)
    torch_dtype = parse_dtype(dtype)
    rows = []  # (checkpoint, mode asked)
    for c in ckpts:
        if not c.is_dir():
            raise FlagError(f"checkpoint folder {c} does not exist")
        rows += [(c, stored_mode(c))] if is_prequantized(c) else [(c, m) for m in modes]
    base_dir = path_flag("base", base) if base is not None else next((c for c in ckpts if not is_prequantized(c)), None)
    if base_dir is not None and is_prequantized(base_dir):
        raise FlagError(f"--base {base_dir} holds quantized weights; give a bf16 checkpoint")

    # Every checkpoint of one table shares the tokenizer: the first folder's (or llama-models' copy).
    tokenizer = find_tokenizer(base_dir or ckpts[0])
    wins = windows(tokenizer.encode(content, bos=False, eos=False), ctx, tokenizer.bos_id, chunks)
    build = dict(max_seq_len=ctx, max_batch_size=1, world_size=world_size, dtype=torch_dtype)
    results = []
    with tempfile.TemporaryDirectory(prefix="llama-lite-ppl-") as tmp:
        store = Path(tmp)
        base_res = None
        if base_dir is not None:
            llama = build_llama(base_dir, "none", **build)
            base_res = score(llama, wins, store, None)
            del llama
            gc.collect()
        for c, mode in rows:
            if base_dir is not None and mode == "none" and not is_prequantized(c) and c.resolve() == base_dir.resolve():
                results.append((c, "none", {**base_res, "kld_mean": 0.0, "kld_p99": 0.0, "top1": 1.0}))
                continue
            llama = build_llama(c, mode, **build)
            res = score(llama, wins, store, store if base_dir is not None else None)
            results.append((c, getattr(llama, "quantization_mode", mode), res))
            del llama
            gc.collect()
    if not is_main():
        return
    n = results[0][2]["tokens"]
    print(f"{len(wins)} window(s) of {ctx} tokens, {n} scored tokens"
          + (f"; KL divergence against {base_dir} (bf16)" if base_dir is not None else ""))
    print("| checkpoint | mode | PPL | mean KLD | 99% KLD | top-1 agreement |")
    print("|---|---|---:|---:|---:|---:|")
    for c, mode, r in results:
        kl = (f"{r['kld_mean']:.5f} | {r['kld_p99']:.5f} | {100 * r['top1']:.2f}%" if "kld_mean" in r else " | | ")
        print(f"| {c.name} | {mode} | {r['ppl']:.4g} | {kl} |")


if __name__ == "__main__":
    run_cli(main)
