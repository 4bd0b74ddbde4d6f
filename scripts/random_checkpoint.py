"""Write a random-weight Llama 4 checkpoint for tests, demos and benchmarks (no download needed).

    python -m scripts.random_checkpoint OUT [--preset tiny|small|bench] [--mp 1] [--seed 0] [--format meta|hf]
        [--vision] [--force]

Presets: tiny (~54M parameters, every feature on, for tests), small (~130M, demos), bench (~4.6B,
about 9 GB, benchmarks). Weights are generated and written one layer at a time, so memory stays
far below the checkpoint's size. --vision adds a small vision tower (56-pixel tiles), as in
Llama4ForConditionalGeneration, so image chat runs without downloads.
"""

from pathlib import Path

from llama_lite.synthetic import PRESETS, VISION_ARGS, checkpoint_bytes, preset_args, write_random_checkpoint
from scripts.common import FlagError, path_flag, run_cli


def main(
    out_dir: str,
    preset: str = "tiny",
    mp: int = 1,
    seed: int = 0,
    format: str = "meta",  # noqa: A002 - the flag is --format
    vision: bool = False,
    force: bool = False,
) -> None:
    """Write a random Llama 4 checkpoint folder: weights, params.json or config.json, and tokenizer.model.

    Args:
        out_dir: Folder to create; it must not exist unless --force is given.
        preset: Model size: tiny (tests), small (demos) or bench (benchmarks, about 9 GB).
        mp: Number of model-parallel shards (consolidated.NN.pth files) to write; Meta layout only.
        seed: Random seed of the weights; the same seed gives the same weights in every layout and MP size.
        format: meta (params.json + consolidated.NN.pth) or hf (config.json + model.safetensors).
        vision: Add a vision tower (encoder, adapter, projection) for image chat: vision_args in params.json,
            or a Llama4ForConditionalGeneration config.json.
        force: Replace out_dir if it exists.
    """
    out = path_flag("out_dir", out_dir)
    if preset not in PRESETS:
        raise FlagError(f"unknown --preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if format not in ("meta", "hf"):
        raise FlagError(f"unknown --format {format!r}; choose meta or hf")
    if not isinstance(mp, int) or isinstance(mp, bool) or mp < 1:
        raise FlagError(f"--mp must be a positive integer, got {mp!r}")
    if format == "hf" and mp != 1:
        raise FlagError("--format hf is written unsharded; use --mp 1")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise FlagError(f"--seed must be an integer, got {seed!r}")
    if out.exists() or out.is_symlink():
        if not force:
            raise FlagError(f"{out} already exists; pass --force to replace it")
        if not out.is_dir() or out.is_symlink():
            raise FlagError(f"{out} is not a folder; --force replaces only a checkpoint folder")

    if not isinstance(vision, bool):
        raise FlagError(f"--vision takes no value, got {vision!r}")
    overrides = {"vision_args": VISION_ARGS} if vision else {}
    args = preset_args(preset, **overrides)
    total = checkpoint_bytes(args)
    write_with_progress(out, total, preset=preset, mp=mp, seed=seed, fmt=format, overrides=overrides)
    tower = ", with a vision tower" if vision else ""
    print(f"wrote {out}: {preset} preset{tower}, {format} layout, {mp} shard(s), {total / 1e9:.2f} GB of weights")


def write_with_progress(out: Path, total: int, **kwargs) -> None:
    """write_random_checkpoint with a progress bar on stderr (drawn only on a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"writing {out.name}", total=total)
        write_random_checkpoint(out, progress=lambda n: bar.advance(task, n), **kwargs)


if __name__ == "__main__":
    run_cli(main)
