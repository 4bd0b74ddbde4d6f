"""Continue a text prompt with a Llama 4 checkpoint (no chat template) and print only the new text.

    python -m scripts.completion CKPT --prompt "The capital of France is" --max_gen_len 16 --temperature 0
    torchrun --nproc-per-node 2 -m scripts.completion CKPT --world_size 2 --prompt "..." --temperature 0
"""

from typing import Optional

from scripts.common import (
    FlagError,
    build_llama,
    check_flags,
    check_kv_cache_dtype,
    check_quantization_mode,
    set_kernels,
    parse_dtype,
    path_flag,
    run_cli,
    stream_text,
    text_flag,
)


def main(
    checkpoint_dir: str,
    prompt: Optional[str] = None,
    world_size: Optional[int] = None,
    max_seq_len: int = 4096,
    max_batch_size: int = 1,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_gen_len: Optional[int] = None,
    quantization_mode: str = "none",
    seed: int = 1,
    tokenizer_path: Optional[str] = None,
    dtype: str = "bf16",
    kernels: str = "auto",
    kv_cache_dtype: Optional[str] = None,
    compile: Optional[bool] = None,  # noqa: A002 - the flag is --compile
    int8_activations: bool = False,
) -> None:
    """Print the model's continuation of a prompt, streamed as it is generated.

    Args:
        checkpoint_dir: Folder of the checkpoint: Meta's layout (params.json, consolidated.NN.pth) or Hugging
            Face's (config.json, *.safetensors). Any model-parallel size is resharded to the world size.
        prompt: The text to continue (required); it is encoded after a begin-of-text token, without chat framing.
        world_size: Number of model-parallel processes; must equal the number torchrun launched. By default
            torchrun's WORLD_SIZE, or 1 without torchrun.
        max_seq_len: Longest prompt plus continuation in tokens the KV cache holds.
        max_batch_size: Rows of the KV cache (one prompt needs 1).
        temperature: Sampling temperature; 0 picks the most likely token (greedy).
        top_p: Nucleus sampling: sample from the most likely tokens whose probabilities add up to top_p, in (0, 1].
        max_gen_len: Most new tokens (default: until a stop token or max_seq_len).
        quantization_mode: How weights are held: none (unquantized, as --dtype), int4_mixed, fp8_mixed, w4a8 or nvfp4.
            A Hugging Face quantized folder (compressed-tensors, fbgemm_fp8) runs in its own mode when none is given.
        seed: Random seed for sampling (the same on every rank, so ranks agree on every token).
        tokenizer_path: A tokenizer.model to use instead of the checkpoint folder's (or llama-models' copy).
        dtype: Number format of weights and activations, bf16 or fp32. fp32 takes twice the memory, gives
            the same greedy tokens at every world size, and is faster on CPUs without bf16 arithmetic.
        kernels: Compute path of quantized layers (and, on a CPU in bf16, of the layers left in bf16):
            auto (fastest correct one for the device), reference (plain torch), cpu (CPU fast paths) or
            triton (CUDA GPUs).
        kv_cache_dtype: Number format of the KV cache: bf16, fp32, or fp8 (e4m3 with a scale per token and
            head: about half of bf16's memory; logits moved by ~0.2 on a test model); default as --dtype.
        compile: Compile the decode step (torch.compile; CUDA graphs on a GPU) at load, which takes from
            a minute to several once (printed); one process only. Default: on for one CUDA GPU (3-6x
            eager's decode speed on an H200), off on a CPU (measured no faster than eager); the
            environment's LLAMA_LITE_COMPILE=1 / 0 overrides it.
        int8_activations: With int4 weights (int4_mixed), quantize each int4 layer's activations to int8 per
            32 values and multiply with integer dot products: faster on CPUs, slightly lossy (on MiniLM's
            real layers the output error grew from 0.1036 to 0.1038; see scripts.quant_error).
    """
    ckpt = path_flag("checkpoint_dir", checkpoint_dir)
    prompt = text_flag("prompt", prompt)
    if prompt is None:
        raise FlagError("--prompt is required: give the text to continue")
    if prompt == "":
        raise FlagError("--prompt is empty; give the text to continue")
    mode = check_quantization_mode(quantization_mode)
    check_flags(world_size=world_size, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                temperature=temperature, top_p=top_p, max_gen_len=max_gen_len, seed=seed)
    kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
    set_kernels(kernels)
    llama = build_llama(ckpt, mode, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                        world_size=world_size, seed=seed, dtype=parse_dtype(dtype), kv_cache_dtype=kv_cache_dtype, compile=compile,
                        int8_activations=int8_activations,
                        tokenizer_path=None if tokenizer_path is None else path_flag("tokenizer_path", tokenizer_path))
    stream_text(llama, llama.completion([prompt], temperature=temperature, top_p=top_p, max_gen_len=max_gen_len))
    print()


if __name__ == "__main__":
    run_cli(main)
