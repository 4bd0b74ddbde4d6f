"""Quantize a checkpoint with N ranks, one layer at a time, into llama-lite's pre-quantized format.

    torchrun --nproc-per-node 8 -m scripts.quantize --ckpt_dir IN --output_dir OUT \\
        --quantization_mode int4_mixed --world_size 8

Each rank quantizes whole weights and keeps its slice, so the output loads at any world size.
The output is written to a hidden temporary folder beside OUT and renamed into place only when
every rank has finished: a run that dies leaves no folder that looks complete.

``--format compressed-tensors`` writes a Hugging Face folder instead (config.json with
``quantization_config``, safetensors, tokenizer) that transformers + compressed-tensors and vLLM
load; see ``quantization.export_compressed_tensors``.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from llama_lite.checkpoint import Checkpoint, read_model_args
from llama_lite.distributed import init_distributed
from llama_lite.errors import CheckpointError, ConfigError
from llama_lite.generation import find_tokenizer
from llama_lite.model import Transformer
from quantization.checkpoint_io import FORMAT_VERSION, QUANT_CONFIG, flatten_weight, save_rank_file, weight_meta
from quantization.convert import convert_to_quantized_model
from quantization.export_compressed_tensors import write_compressed_tensors_folder
from quantization.modes import DEFAULT_TARGETS, QuantizationMode, parse_mode
from quantization.modules import QuantizedExperts, QuantizedFeedForward, QuantizedLinear
from scripts.common import run_cli

OUTPUT_FORMATS = ("llama-lite", "compressed-tensors")


def collect_tensors(model: Transformer) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """This rank's tensors under their stored names, and quantization.json's per-weight entries."""
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    for path, module in model.named_modules():
        if isinstance(module, (QuantizedExperts, QuantizedFeedForward)):
            suffix = "" if isinstance(module, QuantizedExperts) else ".weight"
            for attr, split in (("w1", "N"), ("w3", "N"), ("w2", "K")):
                name = f"{path}.{attr}{suffix}"
                w = getattr(module, attr)
                tensors.update(flatten_weight(name, w))
                entries[name] = weight_meta(w, split)
        elif isinstance(module, QuantizedLinear):
            name = f"{path}.weight"
            tensors.update(flatten_weight(name, module.weight))
            entries[name] = weight_meta(module.weight, "K" if module.parallel == "row" else "N")
    for name, param in model.named_parameters():
        tensors[name] = param.detach()
    return tensors, entries


def _agree(ok: bool, world_size: int) -> bool:
    """True when every rank reports success (so no rank commits a partial output)."""
    if world_size == 1:
        return ok
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag) == 0


def quantize(
    ckpt_dir: str,
    output_dir: str,
    quantization_mode: str = "int4_mixed",
    world_size: Optional[int] = None,
    targets: Optional[str] = None,
    group_size: int = 128,
    fp8_activation_scale_ub: float = 1200.0,
    force: bool = False,
    format: str = "llama-lite",
) -> None:
    """Quantize CKPT_DIR (bf16 Meta/Hugging Face layout, or an int4 output for w4a8) into OUTPUT_DIR.

    Args:
        ckpt_dir: the checkpoint folder to read.
        output_dir: the folder to create (refused if it exists, unless --force).
        quantization_mode: int4_mixed, fp8_mixed, w4a8 or nvfp4.
        world_size: number of ranks (torchrun's --nproc-per-node); each writes one model.NN.safetensors.
        targets: comma-separated parts to quantize (experts, shared_expert, ffn, attention, output, or
            "all"); by default the mode's own.
        group_size: int4 / w4a8 group size along the input dimension.
        fp8_activation_scale_ub: upper bound of fp8 per-token activation scales (stored for loading).
        force: replace an existing output folder.
        format: llama-lite (this package's format, one file per rank) or compressed-tensors (a Hugging
            Face folder that transformers and vLLM load; one rank; w4a8 is written as W4AFP8, the int4
            weights and bf16 group scales its fp8 and channel scales are derived from on load).
    """
    mode = parse_mode(quantization_mode)
    if mode == QuantizationMode.none:
        raise ConfigError("choose a quantization mode other than none (int4_mixed, fp8_mixed, w4a8, nvfp4)")
    if not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"group_size must be a positive integer, got {group_size!r}")
    out = Path(output_dir).expanduser().resolve()
    src = Path(ckpt_dir).expanduser()
    if out.exists() and not force:
        raise ConfigError(f"{out} already exists; pass --force to replace it")
    if out == src.resolve():
        raise ConfigError("output_dir must differ from ckpt_dir")
    if format not in OUTPUT_FORMATS:
        raise ConfigError(f"unknown --format {format!r}; choose one of {', '.join(OUTPUT_FORMATS)}")
    rank, world = init_distributed(world_size, "cpu")
    if format == "compressed-tensors" and world > 1:
        raise ConfigError("compressed-tensors output is written by one rank; run with --world_size 1")

    args = read_model_args(src)
    tokenizer = find_tokenizer(src)
    if args.vocab_size == -1:
        args.vocab_size = tokenizer.n_words
    checkpoint = Checkpoint(src, args, world_size=world, rank=rank)
    checkpoint.device, checkpoint.dtype = torch.device("cpu"), torch.bfloat16
    with torch.device("meta"):
        model = Transformer(args).to_empty(device="meta")
    # compressed-tensors holds w4a8 as the int4 weights and bf16 group scales it is derived from
    derived = format == "compressed-tensors" and mode == QuantizationMode.w4a8
    if derived and targets is None:
        targets = ",".join(DEFAULT_TARGETS[mode])
    model = convert_to_quantized_model(
        model, checkpoint, QuantizationMode.int4_mixed if derived else mode, targets=targets, group_size=group_size,
        fp8_activation_scale_ub=fp8_activation_scale_ub, prepare=False,
    )
    if format == "compressed-tensors":
        _write_hf(model, args, tokenizer.model_path, out, mode, derived)
        return
    tensors, entries = collect_tensors(model)

    # Rank 0 picks the temporary folder; everyone writes there.
    holder = [None]
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        holder[0] = tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    if world > 1:
        dist.broadcast_object_list(holder, src=0)
    tmp = Path(holder[0])

    error = None
    try:
        save_rank_file(tmp / f"model.{rank:02d}.safetensors", tensors)
    except OSError as e:
        error = f"could not write {tmp}: {e.strerror or e}"
    ok = _agree(error is None, world)
    if rank == 0:
        def finish(folder: Path) -> None:
            if not ok:
                raise CheckpointError(error or "another rank failed to write its part; nothing was written")
            config = {
                "format_version": FORMAT_VERSION, "quantization_mode": mode.value, "mp": world,
                "group_size": group_size,
                "targets": sorted({t for t in _targets_of(entries)}),
                "tensors": entries,
            }
            (folder / QUANT_CONFIG).write_text(json.dumps(config, indent=1))
            (folder / "params.json").write_text(json.dumps(args.to_params(), indent=2))
            shutil.copyfile(tokenizer.model_path, folder / "tokenizer.model")

        _write_and_commit(tmp, out, finish)
        print(f"wrote {out} ({mode.value}, {world} rank file(s))")
    if world > 1:
        dist.barrier()
    if not ok:
        raise CheckpointError(error or "another rank failed to write its part; nothing was written")


def _write_hf(model: Transformer, args, tokenizer_path, out: Path, mode: QuantizationMode, w4a8: bool) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    _write_and_commit(tmp, out, lambda folder: write_compressed_tensors_folder(
        model, args, Path(tokenizer_path), folder, w4a8=w4a8))
    print(f"wrote {out} ({mode.value}, compressed-tensors)")


def _targets_of(entries: dict) -> set[str]:
    found = set()
    for name in entries:
        if ".experts." in name:
            found.add("experts")
        elif ".shared_expert." in name:
            found.add("shared_expert")
        elif ".feed_forward." in name:
            found.add("ffn")
        elif ".attention." in name:
            found.add("attention")
        elif name.startswith("output."):
            found.add("output")
    return found


def _write_and_commit(tmp: Path, out: Path, write: Callable[[Path], None]) -> None:
    """``write`` into the temporary folder, then ``_commit`` it; on any failure the folder goes and
    nothing was written (an OSError becomes one CheckpointError sentence)."""
    try:
        write(tmp)
        _commit(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write {out}: {e.strerror or e}; nothing was written") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _commit(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place; an old output (with --force) goes only after that."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main() -> None:
    run_cli(quantize)


if __name__ == "__main__":
    main()
