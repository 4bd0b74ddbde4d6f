"""What the command-line scripts share: running a function under fire with clean errors, rank-0-only
output under torchrun, flag checks, building the model, broadcasting input, and streaming text."""

import codecs
import inspect
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, get_type_hints

import torch

from llama_lite import Llama4
from llama_lite.errors import LlamaLiteError
from llama_lite.tokenizer import Tokenizer

# The modes of the design (quantization.QuantizationMode).
QUANTIZATION_MODES = ("none", "int4_mixed", "fp8_mixed", "w4a8", "nvfp4")

# --dtype values: bf16 as the checkpoints are stored; fp32 gives the same greedy tokens at every world size
# (bf16 rounds the model-parallel partial sums differently) and is faster on CPUs without bf16 units.
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# --kv_cache_dtype values (None: as --dtype); fp8 is e4m3 with one scale per token and KV head.
KV_CACHE_DTYPES = ("bf16", "fp8", "fp32")

# Exit status for errors the user can fix (flags, files, prompts), as for a usage error.
USER_ERROR_STATUS = 2


class FlagError(ValueError):
    """A command-line flag has a value the script cannot use."""


# Help text of the flags several scripts share, as fire shows it (from the Args: section of a script's
# main docstring). A docstring names one with a line ``{name}`` where its entry goes; with_flag_help
# puts the text there, so every script says the same of the same flag. fire keeps only what precedes
# a colon on an entry's later lines, so those have none.
FLAG_HELP = {
    "checkpoint_dir": """Folder of the checkpoint: Meta's layout (params.json, consolidated.NN.pth) or Hugging
    Face's (config.json, *.safetensors). Any model-parallel size is resharded to the world size.""",
    "world_size": """Number of model-parallel processes; must equal the number torchrun launched. By default
    torchrun's WORLD_SIZE, or 1 without torchrun.""",
    "temperature": "Sampling temperature; 0 picks the most likely token (greedy).",
    "top_p": "Nucleus sampling: sample from the most likely tokens whose probabilities add up to top_p, in (0, 1].",
    "quantization_mode": """How weights are held: none (unquantized, as --dtype), int4_mixed, fp8_mixed, w4a8 or nvfp4.
    A Hugging Face quantized folder (compressed-tensors, fbgemm_fp8) runs in its own mode when none is given.""",
    "seed": "Random seed for sampling (the same on every rank, so ranks agree on every token).",
    "tokenizer_path": "A tokenizer.model to use instead of the checkpoint folder's (or llama-models' copy).",
    "dtype": """Number format of weights and activations, bf16 or fp32. fp32 takes twice the memory, gives
    the same greedy tokens at every world size, and is faster on CPUs without bf16 arithmetic.""",
    "kernels": """Compute path of quantized layers (and, on a CPU in bf16, of the layers left in bf16):
    auto (fastest correct one for the device), reference (plain torch), cpu (CPU fast paths) or
    triton (CUDA GPUs).""",
    "kv_cache_dtype": """Number format of the KV cache: bf16, fp32, or fp8 (e4m3 with a scale per token and
    head, about half of bf16's memory; logits moved by ~0.2 on a test model); default as --dtype.""",
    "compile": """Compile the decode step (torch.compile; CUDA graphs on a GPU) at load, which takes from
    a minute to several once (printed); one process only. On by default for one CUDA GPU (3-6x
    eager's decode speed on an H200), off on a CPU (measured no faster than eager); the
    environment's LLAMA_LITE_COMPILE=1 / 0 overrides it.""",
    "int8_activations": """With int4 weights (int4_mixed), quantize each int4 layer's activations to int8 per
    32 values and multiply with integer dot products, faster on CPUs and slightly lossy (on MiniLM's
    real layers the output error grew from 0.1036 to 0.1038; see scripts.quant_error).""",
}


# Names a docstring line ``{group}`` stands for, in order: how the chat scripts build a model.
FLAG_GROUPS = {"build_flags": ("tokenizer_path", "dtype", "kernels", "kv_cache_dtype", "compile", "int8_activations")}


def with_flag_help(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Fill each ``{name}`` line of fn's docstring with ``name: FLAG_HELP[name]``, indented as the line
    (a FLAG_GROUPS name: one such entry per flag of the group)."""

    def entry(match: "re.Match[str]") -> str:
        indent, name = match.group(1), match.group(2)
        return "\n".join(indent + f"{n}: {FLAG_HELP[n]}".replace("\n", "\n" + indent)
                         for n in FLAG_GROUPS.get(name, (name,)))

    fn.__doc__ = re.sub(r"^( *)\{(\w+)\}$", entry, fn.__doc__ or "", flags=re.M)
    return fn


# --- process and output -----------------------------------------------------------------
def rank() -> int:
    """This process's global rank under torchrun (0 without it)."""
    return int(os.environ.get("RANK", 0))


def is_main() -> bool:
    return rank() == 0


def _one_line(message: str) -> str:
    # Some messages quote a lower-level error that spans lines; the user gets one line.
    return " ".join(message.split())


def print_error(message: str) -> None:
    """``error: <message>`` on stderr; other ranks name themselves so a lone failing rank is visible."""
    where = "" if is_main() else f" (rank {rank()})"
    print(f"error{where}: {_one_line(message)}", file=sys.stderr, flush=True)


def run_cli(fn: Callable[..., Any]) -> None:
    """Run ``fn`` as a fire command line; never returns.

    User errors (``LlamaLiteError``, ``FlagError``) print one line and exit with status 2, without a
    traceback; fire's own usage errors exit 2 as well. Under torchrun only rank 0 writes to
    stdout, so the output reads as that of one process.
    """
    import fire

    if not is_main():
        # Every rank runs the same code; the other ranks' output would only repeat rank 0's.
        sys.stdout = open(os.devnull, "w")
    status = 0
    try:
        argv = quote_text_flags(fn, gather_list_flags(fn, sys.argv[1:]))
        check_flag_names(fn, argv)
        fire.Fire(fn, command=argv, name=_command_name(fn))
    except FlagError as e:
        if is_main():  # every rank has the same flags, so the same error: say it once
            print_error(str(e))
        status = USER_ERROR_STATUS
    except LlamaLiteError as e:
        print_error(str(e))  # files and prompts can fail on one rank only: every rank speaks
        status = USER_ERROR_STATUS
    except KeyboardInterrupt:
        print(file=sys.stderr)
        status = 130
    except BrokenPipeError:
        # The reader went away (e.g. `| head`); nothing left to say.
        status = 0
    except SystemExit as e:  # fire.core.FireExit: usage error (2) or --help (0)
        status = e.code if isinstance(e.code, int) else 1
    finally:
        _shutdown_distributed()
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        # Keep Python from reporting the broken pipe again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(status)


def check_flag_names(fn: Callable[..., Any], argv: list[str]) -> None:
    """Refuse a misspelt flag before anything runs: fire would first run the whole command with its
    defaults and only then complain about the flag it could not use."""
    params = inspect.signature(fn).parameters
    # fire's --noNAME sets a boolean flag False (also one typed Optional[bool], default None = auto)
    known = set(params) | {"help"} | {"no" + n for n, p in params.items()
                                      if isinstance(p.default, bool) or "bool" in str(p.annotation)}
    for arg in argv:
        if arg == "--":  # fire's own flags follow
            return
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0].replace("-", "_")
            if name not in known:
                raise FlagError(f"unknown flag --{name}; see --help for the flags")


def _text_params(fn: Callable[..., Any]) -> set[str]:
    return {name for name, hint in get_type_hints(fn).items() if hint in (str, Optional[str])}


def quote_text_flags(fn: Callable[..., Any], argv: list[str]) -> list[str]:
    """Hand fire the values of str parameters as Python string literals.

    fire evaluates every value as a Python literal: `--prompt "hello, world"` would arrive as the
    tuple ('hello', 'world'), `--prompt 1e3` as 1000.0 and `--prompt None` as None. A quoted value
    arrives as the text the user typed.
    """
    text = _text_params(fn)
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":  # fire's own flags follow
            return out + argv[i:]
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = name.replace("-", "_")
        if key in text and eq:
            out.append(f"--{name}={value!r}")
        elif key in text and i + 1 < len(argv):
            out += [arg, repr(argv[i + 1])]
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


def gather_list_flags(fn: Callable[..., Any], argv: list[str]) -> list[str]:
    """Let flags of list[str] parameters repeat: `--image a.png --image b.png` reaches ``fn`` as
    image=["a.png", "b.png"] (fire alone would keep only the last one). Values stay as typed."""
    lists = {name for name, hint in get_type_hints(fn).items() if hint in (list[str], Optional[list[str]])}
    values: dict[str, list[str]] = {}
    out: list = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out += argv[i:]
            break
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = name.replace("-", "_")
        if key in lists and (eq or i + 1 < len(argv)):
            if not eq:
                value = argv[i + 1]
                i += 1
            if key not in values:
                out.append((key,))  # where the flag first appeared; replaced below
            values.setdefault(key, []).append(value)
        else:
            out.append(arg)
        i += 1
    return [f"--{a[0]}={values[a[0]]!r}" if isinstance(a, tuple) else a for a in out]


def _command_name(fn: Callable[..., Any]) -> str:
    """The script's name in fire's usage lines: the module run with `python -m`, else the file name."""
    spec = getattr(sys.modules.get(fn.__module__), "__spec__", None)
    return spec.name if spec is not None else os.path.basename(sys.argv[0])


def _shutdown_distributed() -> None:
    # Without it torch warns at exit that the process group leaked.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# --- flags ------------------------------------------------------------------------------
def check_quantization_mode(quantization_mode: Optional[str]) -> str:
    # None: fire's reading of `--quantization_mode None`, the reference scripts' spelling of no quantization.
    mode = "none" if quantization_mode in (None, "None") else str(quantization_mode)
    if mode not in QUANTIZATION_MODES:
        choices = ", ".join(QUANTIZATION_MODES)
        raise FlagError(f"unknown quantization_mode {quantization_mode!r}; choose one of {choices}")
    return mode


def parse_dtype(dtype: Any) -> torch.dtype:
    if dtype not in DTYPES:
        raise FlagError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_kv_cache_dtype(kv_cache_dtype: Any) -> Optional[str]:
    if kv_cache_dtype is None:
        return None
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise FlagError(f"unknown --kv_cache_dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return kv_cache_dtype


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_flags(
    *,
    world_size: Optional[int] = None,
    max_seq_len: int = 1,
    max_batch_size: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_gen_len: Optional[int] = None,
    seed: int = 1,
) -> None:
    """Reject unusable flag values before the (slow) model load."""
    for name, value in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
        if not _is_int(value) or value < 1:
            raise FlagError(f"--{name} must be a positive integer, got {value!r}")
    if world_size is not None and (not _is_int(world_size) or world_size < 1):
        raise FlagError(f"--world_size must be a positive integer, got {world_size!r}")
    if not _is_number(temperature) or temperature < 0:
        raise FlagError(f"--temperature must be a number >= 0 (0 is greedy), got {temperature!r}")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise FlagError(f"--top_p must be a number in (0, 1], got {top_p!r}")
    if max_gen_len is not None and (not _is_int(max_gen_len) or max_gen_len < 1):
        raise FlagError(f"--max_gen_len must be a positive integer or None, got {max_gen_len!r}")
    if not _is_int(seed):
        raise FlagError(f"--seed must be an integer, got {seed!r}")


def text_flag(name: str, value: Any) -> Optional[str]:
    """A text flag's value. quote_text_flags keeps fire from evaluating `--name VALUE`; a bare `--name`
    still arrives as True, and a value given another way (positionally, or calling main) may be a number."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise FlagError(f"--{name} needs a value")
    if isinstance(value, (int, float)):
        return str(value)
    raise FlagError(f"--{name} must be text, got {value!r}")


def path_flag(name: str, value: Any) -> Path:
    if value is None or value == "":
        raise FlagError(f"{name} is required")
    if isinstance(value, (list, tuple, dict)):
        raise FlagError(f"{name} must be a path, got {value!r}")
    return Path(str(value)).expanduser()


# --- peers -------------------------------------------------------------------------------
def allow_cpu_torchvision() -> None:
    """Let transformers import next to a torchvision whose C extension does not match this torch.

    PyPI's torchvision is a CUDA build: with the CPU torch its import fails registering meta
    kernels for its missing C ops, and transformers' model imports fail with it. Nothing here uses
    those ops, so the registrations become an empty module before torchvision is first imported.
    """
    import types

    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))


# --- the model --------------------------------------------------------------------------
def build_llama(checkpoint_dir, quantization_mode: str = "none", **build_kwargs: Any) -> Llama4:
    """The model of ``checkpoint_dir`` in ``quantization_mode``; ``build_kwargs`` go to ``Llama4.build``.

    The one place where scripts choose how weights are loaded: every mode goes through
    ``quantization.build`` (``none`` on a bf16 folder is the plain bf16 build).
    """
    import quantization

    from llama_lite.memory import format_bytes

    mode = check_quantization_mode(quantization_mode)
    llama = quantization.build(checkpoint_dir, mode, **build_kwargs)
    if is_main():
        kv_dtype = build_kwargs.get("kv_cache_dtype") or {v: k for k, v in DTYPES.items()}.get(
            build_kwargs.get("dtype", torch.bfloat16), "bf16")
        per_rank = " per rank" if llama.world_size > 1 else ""
        print(f"KV cache: {format_bytes(llama.kv_cache_bytes)}{per_rank} ({kv_dtype}) for max_seq_len "
              f"{llama.args.max_seq_len} x max_batch_size {llama.args.max_batch_size}", file=sys.stderr, flush=True)
        if llama.compile_seconds is not None:
            print(f"decode step compiled in {llama.compile_seconds:.1f} s (once per load; --nocompile runs eager)",
                  file=sys.stderr, flush=True)
    return llama


def set_kernels(backend: str) -> None:
    """Choose the compute path of quantized layers: auto, reference, cpu or triton."""
    import kernels

    if backend not in kernels.BACKENDS:
        raise FlagError(f"unknown --kernels {backend!r}; choose one of {', '.join(kernels.BACKENDS)}")
    kernels.set_backend(backend)
    try:
        kernels.cpu.requested_isa()  # LLAMA_LITE_CPU_ISA: refuse a cap this CPU cannot run, up front
    except ValueError as err:
        raise FlagError(str(err)) from None


# --- input and output ---------------------------------------------------------------------
def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank, so all ranks feed the same input to the model together."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def read_line(prompt: str) -> Optional[str]:
    """One line of stdin read on rank 0 and shared with every rank; None at end of input."""
    line: Optional[str] = None
    if is_main():
        print(prompt, end="", flush=True)
        raw = sys.stdin.readline()
        line = raw.rstrip("\r\n") if raw else None
    return broadcast_object(line)


class TextStream:
    """Incremental detokenizer: a token that ends mid-character waits for the next one
    instead of printing a replacement character."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self.decoder.decode(self.tokenizer.model.decode_single_token_bytes(int(token)))

    def flush(self) -> str:
        return self.decoder.decode(b"", final=True)


def stream_text(llama: Llama4, steps: Iterable, out=None, row: int = 0) -> tuple[list[int], Optional[str], float]:
    """Print row ``row`` of generation ``steps`` as it comes; returns (tokens, stop reason, seconds).

    Tokens exclude the stop token. The stop reason is chat's: end_of_turn, end_of_message or
    out_of_tokens.
    """
    out = sys.stdout if out is None else out
    stream, tokens, reason = TextStream(llama.tokenizer), [], "out_of_tokens"
    stops = set(llama.tokenizer.stop_tokens)
    start = time.perf_counter()
    for step in steps:
        r = step[row]
        if r.source != "output" or r.ignore_token:
            continue
        if r.token in stops:
            reason = "end_of_message" if r.token == llama.tokenizer.eom_id else "end_of_turn"
            break
        tokens.append(r.token)
        out.write(stream.push(r.token))
        out.flush()
    out.write(stream.flush())
    out.flush()
    return tokens, reason, time.perf_counter() - start


def speed_line(n_tokens: int, seconds: float) -> str:
    rate = n_tokens / seconds if seconds > 0 else float("inf")
    return f"[{n_tokens} tokens in {seconds:.2f} s, {rate:.1f} tokens/s]"
