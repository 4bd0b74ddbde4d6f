"""The single-device INT4 demo.

    python -m scripts.int4_demo                      # synthetic checkpoint, built once and cached
    python -m scripts.int4_demo CKPT [--prompt TEXT] # bf16 or pre-quantized (int4), any MP size

With no checkpoint it writes the `small` synthetic checkpoint at MP=2 (random weights: the text
is gibberish, the machinery is real), quantizes it to INT4 with two ranks (torchrun, gloo), loads
the result on one device (GPU if present, else CPU), streams a chat reply and reports memory,
load time and speed.
"""

import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from llama_lite.chat_format import RawMessage
from llama_lite.errors import CheckpointError
from quantization import build
from quantization.modules import model_weight_bytes
from scripts.common import run_cli, with_flag_help

DEMO_PROMPT = "Explain in two sentences why quantized inference saves memory."


def cache_dir() -> Path:
    return Path(os.environ.get("LLAMA_LITE_CACHE", Path.home() / ".cache" / "llama-lite")).expanduser()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_synthetic(root: Path) -> Path:
    """small preset at MP=2, quantized to INT4 by two ranks; both cached under ``root``."""
    from llama_lite.synthetic import write_random_checkpoint

    bf16, int4 = root / "small-mp2", root / "small-mp2-int4"
    if not (bf16 / "params.json").is_file():
        print(f"writing the synthetic 'small' checkpoint (MP=2) to {bf16} ...", flush=True)
        write_random_checkpoint(bf16, preset="small", mp=2, seed=0)
    if not (int4 / "quantization.json").is_file():
        print("quantizing it to INT4 with 2 ranks (torchrun, gloo) ...", flush=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), "-m", "scripts.quantize", "--ckpt_dir", str(bf16),
               "--output_dir", str(int4), "--quantization_mode", "int4_mixed", "--world_size", "2", "--force"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("RANK", None)
        env.pop("WORLD_SIZE", None)
        proc = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parent.parent)
        if proc.returncode != 0:
            raise CheckpointError("quantizing the synthetic checkpoint failed (see the messages above)")
    return int4


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@with_flag_help
def demo(
    checkpoint_dir: Optional[str] = None,
    prompt: str = DEMO_PROMPT,
    max_gen_len: int = 64,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_seq_len: int = 1024,
    device: Optional[str] = None,
    compile: Optional[bool] = None,  # noqa: A002 - the flag is --compile
) -> None:
    """Load a checkpoint in INT4 on one device and stream one chat reply.

    Args:
        checkpoint_dir: a bf16 (Meta or Hugging Face layout) or pre-quantized INT4 checkpoint of
            any MP size; by default the cached synthetic demo checkpoint (created on first run).
        prompt: the user message.
        max_gen_len: most tokens to generate.
        temperature: sampling temperature (0 = greedy).
        top_p: nucleus sampling threshold.
        max_seq_len: KV cache length.
        device: cpu or cuda (default: cuda if available).
        {compile}
    """
    ckpt = Path(checkpoint_dir).expanduser() if checkpoint_dir else prepare_synthetic(cache_dir())
    start = time.perf_counter()
    llama = build(ckpt, "int4_mixed", max_seq_len=max_seq_len, max_batch_size=1, world_size=1, device=device,
                  compile=compile)
    load_s = time.perf_counter() - start
    stored, bf16 = model_weight_bytes(llama.model)
    print(f"checkpoint: {ckpt}")
    compiled = f" (of which {llama.compile_seconds:.1f} s compiling the decode step)" if llama.compile_seconds else ""
    print(f"device: {llama.device}   load time: {load_s:.1f} s{compiled}")
    print(f"weights: {stored / 2**20:.0f} MiB in INT4 mode vs {bf16 / 2**20:.0f} MiB in bf16 ({bf16 / stored:.2f}x smaller)")
    print(f"\nuser> {prompt}\nassistant> ", end="", flush=True)
    tokens, t0 = [], time.perf_counter()
    first = None
    for step in llama.chat_completion([[RawMessage("user", prompt)]], temperature=temperature, top_p=top_p,
                                      max_gen_len=max_gen_len):
        r = step[0]
        if first is None:
            first = time.perf_counter() - t0
        tokens.append(r.token)
        if r.token not in llama.tokenizer.stop_tokens:
            print(r.text, end="", flush=True)
        if r.finished:
            break
    elapsed = time.perf_counter() - t0
    decode_s = max(elapsed - (first or 0.0), 1e-9)
    print(f"\n\n{len(tokens)} tokens in {elapsed:.2f} s: first token after {first:.2f} s, "
          f"then {(len(tokens) - 1) / decode_s:.1f} tokens/s")
    print(f"peak memory: {peak_memory_bytes(llama.device) / 2**20:.0f} MiB "
          f"({'GPU allocated' if llama.device.type == 'cuda' else 'process RSS'})")


def main() -> None:
    run_cli(demo)


if __name__ == "__main__":
    main()
