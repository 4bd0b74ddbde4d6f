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
    with_flag_help,
)


@with_flag_help
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
        {checkpoint_dir}
        prompt: The text to continue (required); it is encoded after a begin-of-text token, without chat framing.
        {world_size}
        max_seq_len: Longest prompt plus continuation in tokens the KV cache holds.
        max_batch_size: Rows of the KV cache (one prompt needs 1).
        {temperature}
        {top_p}
        max_gen_len: Most new tokens (default: until a stop token or max_seq_len).
        {quantization_mode}
        {seed}
        {build_flags}
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
