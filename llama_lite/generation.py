"""Building a Llama 4 from a checkpoint folder, and batched, streaming generation."""

import functools
import os
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from .args import ModelArgs
from .chat_format import ChatFormat, RawMessage
from .checkpoint import Checkpoint, load_weights, read_model_args
from .distributed import init_distributed
from .errors import CheckpointError, ConfigError, PromptError
from .kv_cache import parse_kv_cache_dtype
from .memory import available_bytes, check_fits, processes_sharing, stored_bytes
from .model import Transformer
from .result import GenerationResult
from .tokenizer import Tokenizer, default_tokenizer_path

Loader = Callable[[Transformer, Checkpoint], Transformer]


def resolve_device(device=None) -> torch.device:
    """``device``, default the GPU if there is one; a GPU always with its index (torch.cuda.set_device
    refuses a bare "cuda"): under torchrun each rank's own, LOCAL_RANK."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


def find_tokenizer(ckpt_dir: Path, tokenizer_path=None) -> Tokenizer:
    if tokenizer_path is not None:
        return Tokenizer(tokenizer_path)
    local = ckpt_dir / "tokenizer.model"
    return Tokenizer(local if local.is_file() else default_tokenizer_path())


def compile_by_default(device, world_size: int) -> bool:
    """Whether ``Llama4.build(compile=None)`` compiles the decode step: as LLAMA_LITE_COMPILE says
    (1 / true / yes / on, anything else set: off), else on for one CUDA device (CUDA graphs) and off
    on a CPU (see ``build``); never with a world size above 1."""
    said = os.environ.get("LLAMA_LITE_COMPILE", "").strip().lower()
    wanted = said in ("1", "true", "yes", "on") if said else torch.device(device).type == "cuda"
    return wanted and world_size == 1


class Llama4:
    @staticmethod
    def build(
        ckpt_dir,
        max_seq_len: int,
        max_batch_size: int,
        world_size: Optional[int] = None,
        device=None,
        seed: int = 1,
        convert: Optional[Loader] = None,
        dtype: torch.dtype = torch.bfloat16,
        tokenizer_path=None,
        compile: Optional[bool] = None,
        kv_cache_dtype=None,
        kv_cache_layout: str = "by_kind",
    ) -> "Llama4":
        """Build the model on the meta device and hand it to ``convert`` (default: bf16 weights) to load.

        ``compile``: compile the decode step (``Transformer.compile_decode``; CUDA graphs on a GPU)
        and run it once now, at batch 1, so that the time it takes is part of loading
        (``compile_seconds``); a larger batch compiles once more on first use. One rank only.
        None (default): as the environment's LLAMA_LITE_COMPILE (1 = on, 0 = off), else on for one
        CUDA device (CUDA graphs took an H200's decode step from 3x to 6x eager's speed) and off on
        a CPU, where the compiled step measured no faster than eager (the time left outside the
        weight reads is in the kernels' calls, which stay opaque operators) and compiling takes
        minutes on a large model. Where it is on by that default and compiling fails, the model
        decodes eager, with a warning.
        ``kv_cache_dtype``: "bf16", "fp32" or "fp8" (e4m3 with a scale per token and head: half of
        bf16's memory); default the activations' ``dtype``. ``kv_cache_layout``: "by_kind" (chunked
        layers keep one chunk, global layers max_seq_len) or "full" (max_seq_len on every layer).
        Weights plus KV cache must fit in the device's free memory, or a ConfigError says which
        max_seq_len would; ``kv_cache_bytes`` holds the KV cache's size.
        """
        for name, value in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        start = time.perf_counter()
        device = resolve_device(device)
        rank, world_size = init_distributed(world_size, device.type)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.manual_seed(seed)

        args = read_model_args(ckpt_dir, max_seq_len=max_seq_len, max_batch_size=max_batch_size)
        kv_dtype = parse_kv_cache_dtype(kv_cache_dtype, dtype)
        free, sharing = available_bytes(device), processes_sharing(device)
        where = "GPU memory" if device.type == "cuda" else "RAM"
        # The KV cache alone may already be too large: say so before spending time on the weights.
        check_fits(args, None, free, kv_dtype, kv_cache_layout, world_size, sharing, where)
        ckpt_path = Path(ckpt_dir).expanduser()
        tokenizer = find_tokenizer(ckpt_path, tokenizer_path)
        if args.vocab_size == -1:
            args.vocab_size = tokenizer.n_words
        if args.vocab_size != tokenizer.n_words:
            raise ConfigError(
                f"the model's vocab_size ({args.vocab_size}) does not match the tokenizer's {tokenizer.n_words} tokens"
            )
        if args.vocab_size % world_size:
            raise ConfigError(f"vocab_size {args.vocab_size} does not divide by world size {world_size}")

        checkpoint = Checkpoint(ckpt_path, args, world_size=world_size, rank=rank)
        checkpoint.device, checkpoint.dtype = device, dtype
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device("meta"):
                model = Transformer(args)
            # fairscale's layers allocate (untouched) CPU storage even under the meta device;
            # move everything to meta so a loader can tell what it has not loaded yet.
            model = model.to_empty(device="meta")
        finally:
            torch.set_default_dtype(default_dtype)
        loader = convert or (lambda m, c: load_weights(m, c, dtype=dtype, device=device))
        model = loader(model, checkpoint)
        left = [n for n, p in model.named_parameters() if p.is_meta]
        if left:
            raise CheckpointError(f"the loader left {len(left)} parameter(s) without weights, e.g. {left[0]!r}")
        model.eval()
        model.use_linear_layout()
        kv_bytes = check_fits(args, stored_bytes(model), free, kv_dtype, kv_cache_layout, world_size, sharing, where)
        model.setup_caches(kv_dtype, device, kv_cache_layout)
        llama = Llama4(model, tokenizer, args)
        auto = compile is None
        if auto:
            compile = compile_by_default(device, world_size)
        elif compile and world_size > 1:
            raise ConfigError("compiled decode runs on one rank; with a world size above 1 build with compile=False")
        if compile:
            t0 = time.perf_counter()
            model.compile_decode("reduce-overhead" if device.type == "cuda" else None)
            try:
                # Compile now (batch 1): a decode step writes row 0, position 0 of the cache, which
                # any generation overwrites before reading it.
                # Inference tensors, as generate's: another kind of tensor would make another graph.
                with torch.inference_mode():
                    model(torch.zeros(1, 1, dtype=torch.long, device=device), 0)
            except Exception as err:  # noqa: BLE001 -- a toolchain problem must not cost the user the model
                if not auto:
                    raise
                model._decode_compiled = None
                warnings.warn(f"compiling the decode step failed ({type(err).__name__}: {str(err)[:200]}); "
                              "decoding eager (compile=False or LLAMA_LITE_COMPILE=0 skips the attempt)")
            else:
                llama.compile_seconds = time.perf_counter() - t0
        llama.load_seconds = time.perf_counter() - start
        llama.device, llama.rank, llama.world_size = device, rank, world_size
        llama.kv_cache_bytes = kv_bytes
        return llama

    def __init__(self, model: Transformer, tokenizer: Tokenizer, args: ModelArgs):
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.formatter = ChatFormat(tokenizer, vision_args=args.vision_args)
        self.device = next(model.parameters()).device
        self.load_seconds = 0.0
        self.compile_seconds = None  # seconds that compiling the decode step took at load; None: eager
        self.kv_cache_bytes = 0
        # Bumped by every generation that starts rows afresh, so a Conversation can tell that
        # its row of the cache was overwritten since it last ran.
        self.cache_epoch = 0

    # --- generation ---------------------------------------------------------------------
    def _check(self, prompts, temperature, top_p, top_k, max_gen_len, start_pos=None) -> int:
        limit = self.args.max_seq_len
        if not prompts:
            raise PromptError("no prompts were given")
        if len(prompts) > self.args.max_batch_size:
            raise PromptError(f"{len(prompts)} prompts exceed max_batch_size {self.args.max_batch_size}")
        if start_pos is not None and len(start_pos) != len(prompts):
            raise PromptError(f"start_pos has {len(start_pos)} entries for {len(prompts)} prompts")
        for i, p in enumerate(prompts):
            start = 0 if start_pos is None else start_pos[i]
            if not isinstance(start, int) or isinstance(start, bool) or start < 0:
                raise PromptError(f"start_pos of prompt {i} must be an integer >= 0, got {start!r}")
            if len(p) == 0:
                raise PromptError(f"prompt {i} is empty")
            if start + len(p) >= limit:
                cached = f" after {start} cached" if start else ""
                raise PromptError(f"prompt {i} has {len(p)} tokens{cached}, which leaves no room under max_seq_len {limit}")
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise PromptError(f"temperature must be >= 0, got {temperature!r}")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise PromptError(f"top_p must be in (0, 1], got {top_p!r}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise PromptError(f"top_k must be a positive integer, got {top_k!r}")
        if max_gen_len is None:
            return limit - 1
        if not isinstance(max_gen_len, int) or isinstance(max_gen_len, bool) or max_gen_len <= 0:
            raise PromptError(f"max_gen_len must be a positive integer, got {max_gen_len!r}")
        return max_gen_len

    @torch.inference_mode()
    def generate(
        self,
        prompt_tokens: Sequence[Sequence[int]],
        temperature: float = 0.6,
        top_p: float = 0.9,
        top_k: Optional[int] = None,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        echo: bool = False,
        seed: Optional[int] = None,
        stop_tokens: Optional[Sequence[int]] = None,
        images: Optional[Sequence[Sequence[torch.Tensor]]] = None,
        start_pos: Optional[Sequence[int]] = None,
    ) -> Iterator[list[GenerationResult]]:
        """Yield, for every step, one result per prompt. Rows advance at their own positions,
        so a prompt's greedy output does not depend on the other prompts in the batch.

        ``images``: per prompt, the tiles [n, 3, H, W] of each image in it, in the order of their
        ``<|patch|>`` runs (``ChatFormat.encode_dialog`` gives both); their patch embeddings take
        the place of those tokens' embeddings.

        ``start_pos``: continue from the cache. Prompt i goes to row i of the KV cache at position
        start_pos[i], after the first start_pos[i] tokens that row already holds (from an earlier
        generation on that row: its prompt and all but the last generated token). Only the new
        tokens are prefilled; the result equals generating from the whole sequence. Default: every
        row starts afresh. ``Conversation`` keeps this bookkeeping for a chat.
        """
        if start_pos is not None and not isinstance(start_pos, (list, tuple)):
            start_pos = list(start_pos) if hasattr(start_pos, "__iter__") else [start_pos] * len(prompt_tokens)
        max_gen_len = self._check(prompt_tokens, temperature, top_p, top_k, max_gen_len, start_pos)
        if start_pos is None:
            self.cache_epoch += 1
        dev, bsz = self.device, len(prompt_tokens)
        lens = torch.tensor([len(p) for p in prompt_tokens], device=dev)
        start = torch.tensor(list(start_pos or [0] * bsz), dtype=torch.long, device=dev)
        gen = torch.Generator(device=dev)
        gen.manual_seed(torch.initial_seed() if seed is None else seed)

        padded = torch.full((bsz, int(lens.max())), self.tokenizer.pad_id, dtype=torch.long, device=dev)
        for i, p in enumerate(prompt_tokens):
            padded[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)

        full = echo and logprobs
        fused = self.image_inputs(padded, images)
        logits = self.model(padded, start, last_index=None if full else lens - 1,
                            lengths=None if bool((lens == lens[0]).all()) else lens, **fused)
        if echo:
            lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, padded[:, 1:, None])[..., 0] if full else None
            for j in range(int(lens.max())):
                yield [
                    GenerationResult(
                        token=int(padded[i, j]), text=self.tokenizer.decode([int(padded[i, j])]), source="input",
                        batch_idx=i, finished=False, ignore_token=j >= int(lens[i]),
                        logprobs=[float(lp[i, j - 1])] if full and j > 0 else ([0.0] if full else None),
                    )
                    for i in range(bsz)
                ]
            logits = logits[torch.arange(bsz, device=dev), lens - 1].unsqueeze(1)

        # The per-step bookkeeping is in Python lists: a dozen operators on tensors of B values cost
        # more than the lists (each ~10-30 us on a CPU, right after a step's weights swept the caches).
        stop_set = {int(t) for t in (stop_tokens if stop_tokens is not None else self.tokenizer.stop_tokens)}
        pos = (start + lens).tolist()  # where each row's next token goes
        lim = [min(p + max_gen_len, self.args.max_seq_len) for p in pos]  # and where it must end
        last = self.args.max_seq_len - 1
        done = [False] * bsz
        while True:
            next_logits = logits[:, -1]
            nxt = sample(next_logits, temperature, top_p, top_k, gen)
            token_lp = None
            if logprobs:
                token_lp = torch.log_softmax(next_logits, dim=-1).gather(-1, nxt[:, None])[:, 0].tolist()
            toks, was_done = nxt.tolist(), done
            done = [d or t in stop_set or p + 1 >= n for d, t, p, n in zip(was_done, toks, pos, lim)]
            yield [
                GenerationResult(
                    token=toks[i], text=self.tokenizer.decode([toks[i]]), source="output", batch_idx=i,
                    finished=done[i], ignore_token=was_done[i], logprobs=[token_lp[i]] if logprobs else None,
                )
                for i in range(bsz)
            ]
            if all(done):
                return
            # Finished rows keep a valid position; their outputs are ignored from here on.
            write = torch.tensor([min(p, last) if d else p for p, d in zip(pos, done)], device=dev)
            logits = self.model(nxt[:, None], write)
            pos = [p if d else p + 1 for p, d in zip(pos, done)]

    def image_inputs(self, tokens: torch.Tensor, images) -> dict:
        """``Transformer.forward``'s image_embeddings / image_mask for a batch of (padded) prompt tokens
        [B, S] and, per prompt, its images' tiles; empty when no prompt has an image."""
        patch = self.tokenizer.special_tokens["<|patch|>"]
        mask = tokens == patch
        tiles = [t for row in images or [] for t in row]
        if images is not None and len(images) != tokens.shape[0]:
            raise PromptError(f"images are given for {len(images)} prompts, but there are {tokens.shape[0]}")
        if not tiles:  # text only: a <|patch|> token, if any, keeps its token embedding
            return {}
        if self.args.vision_args is None:
            raise PromptError("this model has no vision tower, so it cannot read images")
        per_tile = self.args.vision_args.patches_per_tile
        for i, row in enumerate(images):
            want = sum(t.shape[0] for t in row) * per_tile
            if int(mask[i].sum()) != want:
                raise PromptError(
                    f"prompt {i} holds {int(mask[i].sum())} <|patch|> tokens but its images give {want} patch embeddings"
                )
        return dict(image_embeddings=self.model.encode_images(torch.cat(tiles)), image_mask=mask)

    def conversation(self, system: Optional[str] = None):
        """A multi-turn chat on row 0 of the KV cache that prefills only each new message (see ``Conversation``)."""
        from .conversation import Conversation  # it builds on this module

        return Conversation(self, system)

    def generate_tokens(self, prompt_tokens, **kwargs) -> list[list[int]]:
        """Non-streaming generate: the new tokens of each prompt (stop token included when reached)."""
        out: list[list[int]] = [[] for _ in prompt_tokens]
        for step in self.generate(prompt_tokens, **kwargs):
            for r in step:
                if r.source == "output" and not r.ignore_token:
                    out[r.batch_idx].append(r.token)
        return out

    def completion(self, prompts: Sequence[str], **kwargs) -> Iterator[list[GenerationResult]]:
        """Plain-text continuation of each prompt (BOS + text, no chat template)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        tokens = []
        for i, p in enumerate(prompts):
            if not isinstance(p, str) or not p:
                raise PromptError(f"prompt {i} must be a non-empty string")
            tokens.append(self.formatter.encode_content(p))
        yield from self.generate(tokens, **kwargs)

    def chat_completion(self, dialogs: Sequence[Sequence[RawMessage]], **kwargs) -> Iterator[list[GenerationResult]]:
        """Assistant replies to each dialog; decode the tokens with ``formatter.decode_assistant_message``.

        Messages may hold images (``RawMediaItem``) when the model has a vision tower."""
        inputs = [self.formatter.encode_dialog(list(d)) for d in dialogs]
        limit = self.args.max_seq_len
        for i, inp in enumerate(inputs):
            if inp.images and len(inp.tokens) >= limit:
                n = sum(t.tiles.shape[0] for t in inp.images) * self.args.vision_args.patches_per_tile
                raise PromptError(
                    f"dialog {i} takes {len(inp.tokens)} tokens ({n} of them for its {len(inp.images)} image(s)), "
                    f"which leaves no room under max_seq_len {limit}"
                )
        images = [[t.tiles for t in inp.images] for inp in inputs]
        yield from self.generate([inp.tokens for inp in inputs], images=images, **kwargs)


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: Optional[int], gen) -> torch.Tensor:
    """Greedy at temperature 0; otherwise softmax(logits / T) restricted to top-k, then to the top-p nucleus."""
    if temperature == 0:
        return greedy(logits)
    kept_p, idx = nucleus(torch.softmax(logits / temperature, dim=-1), top_p, top_k)
    choice = torch.multinomial(kept_p, 1, generator=gen)
    return idx.gather(-1, choice)[:, 0]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` of logits [B, V] (the first index of each row's largest value,
    a NaN counting as the largest), in two passes: the largest value of each block of a row's
    values, the first block that holds the row's largest, then the first index of it there. On a
    CPU ``amax`` is vectorized and ``argmax`` is not: a 202048-token vocabulary took ~140 us a row
    by ``argmax`` and ~27 us so (blocks of 1232). Other lengths (see ``_block_size``) take ``argmax``."""
    rows, vocab = logits.shape
    size = _block_size(vocab)
    if size is None or logits.stride(-1) != 1:
        return torch.argmax(logits, dim=-1)
    blocks = logits.view(rows, vocab // size, size)
    first = blocks.amax(dim=-1).argmax(dim=-1)  # amax and argmax agree on NaN: it is the largest
    return first * size + blocks[torch.arange(rows, device=logits.device), first].argmax(dim=-1)


@functools.lru_cache(maxsize=None)
def _block_size(vocab: int) -> Optional[int]:
    """``greedy``'s block: the divisor of ``vocab`` in 256..4096 that is a multiple of 16 (whole
    vectors: other blocks measured up to 1.8x slower) and closest to 1024, or None."""
    sizes = [d for d in range(256, 4097, 16) if vocab % d == 0 and vocab // d >= 2]
    return min(sizes, key=lambda d: abs(d - 1024)) if sizes else None


def nucleus(probs: torch.Tensor, top_p: float, top_k: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, token ids) of each row's most likely tokens, most likely first: the top-k, then
    the smallest prefix of them whose mass reaches top_p (the first token always stays), renormalized;
    zeros pad the rows whose nucleus is shorter than another row's. With top_p 1 and no top-k: every
    token, in vocabulary order.

    Only the most likely 256 tokens are sorted (torch.topk) unless the nucleus needs more, then 16384,
    then all: on a CPU a full sort of a 202048-token vocabulary takes ~15 ms a row, longer than a
    quantized decode step, and the top 256 0.4 ms; a flatter distribution costs what a full sort did."""
    rows, vocab = probs.shape
    limit = vocab if top_k is None else min(top_k, vocab)
    if limit == vocab and top_p >= 1:  # every token, in any order
        return probs, torch.arange(vocab, device=probs.device).expand(rows, vocab)
    n = min(limit, 256)
    while True:
        top, idx = torch.topk(probs, n, dim=-1)  # sorted, descending
        mass = torch.cumsum(top, dim=-1)
        # Every token after the n-th is left out once the n tokens' mass is above top_p.
        if n == limit or bool((mass[:, -1] > top_p).all()):
            break
        n = min(limit, 64 * n)
    top[(mass - top) > top_p] = 0.0
    return top / top.sum(dim=-1, keepdim=True), idx
