"""The Llama 4 text tokenizer: a tiktoken BPE with 200000 base tokens and 2048 special tokens.

Token ids match Meta's reference (`llama_models.llama4.tokenizer`) for every input; the
tests compare the two token for token.
"""

from __future__ import annotations

import base64
import binascii
import functools
import importlib.util
import os
import re
import threading
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import AbstractSet, Literal

import tiktoken

from llama_lite.errors import PromptError, TokenizerError

# The pre-tokenization regex of o200k: the BPE ranks were trained on pieces cut this way,
# so any other pattern gives different ids.
SPLIT_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NUM_SPECIAL_TOKENS = 2048

# tiktoken panics on inputs much longer than this, so encode() feeds it slices of at most
# this many characters (the reference cuts at the same places, which keeps ids identical).
MAX_ENCODE_CHARS = 400_000

# A very long run of only-whitespace or only-non-whitespace characters becomes one regex
# piece, and tiktoken's BPE on one huge piece is quadratic (tiktoken issue #195); such runs
# are cut every this many characters, exactly where the reference cuts them.
MAX_RUN_CHARS = 25_000


def _numbered(name: str, start: int, count: int) -> list[str]:
    return [f"<|{name}_reserved_special_token_{i}|>" for i in range(start, start + count)]


def special_token_names() -> list[str]:
    """All 2048 special-token strings in id order; id = number of base tokens + index."""
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"]
    # Chat/tool-use tokens of the post-trained models.
    names += ["<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>", "<|step|>"]
    names += _numbered("text_post_train", 0, 6)
    names += ["<|python_start|>", "<|python_end|>", "<|finetune_right_pad|>"]
    names += _numbered("text_post_train", 8, 61)
    # Image tokens: never produced by this text-only engine, but they occupy ids.
    names += ["<|image_start|>", "<|image_end|>"]
    names += _numbered("vision", 0, 2)
    names += ["<|tile_x_separator|>", "<|tile_y_separator|>"]
    names += _numbered("vision", 2, 4)
    names += ["<|image|>"]
    names += _numbered("vision", 6, 1)
    names += ["<|patch|>"]
    names += _numbered("vision", 7, 1041)
    names += _numbered("reasoning", 0, 8)
    names += ["<|reasoning_thinking_start|>", "<|reasoning_thinking_end|>"]
    # The rest of the 2048 slots are generic reserved tokens.
    names += [f"<|reserved_special_token_{i}|>" for i in range(NUM_SPECIAL_TOKENS - len(names))]
    return names


def default_tokenizer_path() -> Path:
    """The Llama 4 `tokenizer.model` shipped inside the llama-models wheel."""
    # find_spec on a top-level name locates the package without executing its
    # __init__, which would pull in torch, PIL, pydantic and more.
    try:
        spec = importlib.util.find_spec("llama_models")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(folder) / "llama4" / "tokenizer.model"
        if candidate.is_file():
            return candidate
    raise TokenizerError(
        "The Llama 4 tokenizer was not found: run `pip install llama-models` or pass the path "
        "of a tokenizer.model file."
    )


def _starts_like_bpe(head: bytes) -> bool:
    first, newline, _ = head.lstrip().partition(b"\n")
    if newline:
        return re.fullmatch(rb"[A-Za-z0-9+/=]+ +[0-9]+[ \t\r]*", first) is not None
    # No line end within the sample: a short file, or a first line cut by the sample size.
    return re.fullmatch(rb"[A-Za-z0-9+/=]*(?: +[0-9]*[ \t\r]*)?", first) is not None


def _read_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file (one `<base64 bytes> <rank>` per line); strict, so that a
    wrong file fails here rather than producing shifted special-token ids later."""
    try:
        # Look at the start first, so that a multi-gigabyte weights file passed by mistake
        # is rejected without being read into memory.
        with path.open("rb") as f:
            head = f.read(256)
        if not _starts_like_bpe(head):
            raise TokenizerError(f"Tokenizer file {path} is not a tiktoken BPE file (it does not start with text).")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TokenizerError(f"Tokenizer file {path} does not exist.") from None
    except IsADirectoryError:
        raise TokenizerError(f"Tokenizer path {path} is a directory, not a tokenizer.model file.") from None
    except UnicodeDecodeError:
        raise TokenizerError(f"Tokenizer file {path} is not a tiktoken BPE file (it is not UTF-8 text).") from None
    except OSError as e:
        raise TokenizerError(f"Tokenizer file {path} cannot be read: {e.strerror or e}.") from None

    ranks: dict[bytes, int] = {}
    n_lines = 0
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        n_lines += 1
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (ValueError, binascii.Error):
            raise TokenizerError(
                f"Tokenizer file {path} is not a tiktoken BPE file (line {line_no} is not `<base64> <rank>`)."
            ) from None
    # Special ids are numbered from len(ranks), so ranks must be exactly 0..n-1.
    if not ranks or len(ranks) != n_lines or set(ranks.values()) != set(range(len(ranks))):
        raise TokenizerError(
            f"Tokenizer file {path} is not a usable tiktoken BPE file "
            "(its ranks are not unique and contiguous from 0)."
        )
    return ranks


# Loading the BPE file takes a good fraction of a second, so each file is read once per process; the key
# includes mtime and size so a file replaced on disk is read again.
_cache_lock = threading.Lock()
_encodings: dict[tuple[str, int, int], tuple[tiktoken.Encoding, int, dict[str, int]]] = {}
_default_instance: Tokenizer | None = None


def _load_encoding(path: Path) -> tuple[tiktoken.Encoding, int, dict[str, int]]:
    try:
        resolved = path.resolve()
        st = resolved.stat()
    except FileNotFoundError:
        raise TokenizerError(f"Tokenizer file {path} does not exist.") from None
    except OSError as e:
        raise TokenizerError(f"Tokenizer file {path} cannot be read: {e.strerror or e}.") from None
    key = (str(resolved), st.st_mtime_ns, st.st_size)
    with _cache_lock:
        if key not in _encodings:
            ranks = _read_ranks(resolved)
            n_base = len(ranks)
            specials = {name: n_base + i for i, name in enumerate(special_token_names())}
            encoding = tiktoken.Encoding(
                name=resolved.name, pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials
            )
            _encodings[key] = (encoding, n_base, specials)
        return _encodings[key]


@functools.lru_cache(maxsize=8)
def _long_run_regex(limit: int) -> re.Pattern[str]:
    # A match starts at the first character of a run (the look-behind forbids a preceding
    # character of the same class), so the scan stays linear. Python's \s is str.isspace().
    return re.compile(rf"(?<!\S)\S{{{limit + 1},}}|(?<!\s)\s{{{limit + 1},}}")


def split_long_runs(s: str, limit: int = MAX_RUN_CHARS) -> list[str]:
    """Cut `s` so that no piece holds more than `limit` consecutive whitespace or
    non-whitespace characters: a run starting at p is cut at p + limit, p + 2*limit, ...
    Always returns at least one piece (the empty string for empty input)."""
    cuts = [
        cut
        for m in _long_run_regex(limit).finditer(s)
        for cut in range(m.start() + limit, m.end(), limit)
    ]
    if not cuts:
        return [s]
    bounds = [0, *cuts, len(s)]
    return [s[a:b] for a, b in zip(bounds, bounds[1:])]


def _pieces(s: str) -> Iterator[str]:
    for start in range(0, len(s), MAX_ENCODE_CHARS):
        yield from split_long_runs(s[start : start + MAX_ENCODE_CHARS])


class Tokenizer:
    """Encode and decode Llama 4 text; instances built from the same file share one BPE table."""

    def __init__(self, model_path: str | os.PathLike[str]):
        path = Path(model_path)
        self.model_path = path
        self.model, n_base, specials = _load_encoding(path)
        self.special_tokens: dict[str, int] = dict(specials)
        self.n_words: int = n_base + len(self.special_tokens)

        self.bos_id: int = self.special_tokens["<|begin_of_text|>"]
        self.eos_id: int = self.special_tokens["<|end_of_text|>"]
        self.pad_id: int = self.special_tokens["<|finetune_right_pad|>"]
        self.eot_id: int = self.special_tokens["<|eot|>"]
        self.eom_id: int = self.special_tokens["<|eom|>"]
        self.thinking_start_id: int = self.special_tokens["<|reasoning_thinking_start|>"]
        self.thinking_end_id: int = self.special_tokens["<|reasoning_thinking_end|>"]
        # Any of these ends a generation; order as in the reference.
        self.stop_tokens: list[int] = [self.eos_id, self.eom_id, self.eot_id]

    @classmethod
    def from_default(cls) -> Tokenizer:
        """The tokenizer shipped with llama-models (one shared instance per process)."""
        global _default_instance
        if _default_instance is None:
            _default_instance = cls(default_tokenizer_path())
        return _default_instance

    def encode(
        self,
        s: str,
        *,
        bos: bool,
        eos: bool,
        allowed_special: Literal["all"] | AbstractSet[str] | None = None,
        disallowed_special: Literal["all"] | Collection[str] = (),
    ) -> list[int]:
        """Token ids of `s`, optionally framed by BOS/EOS.

        By default special-token strings in `s` (e.g. "<|eot|>" typed by a user) are encoded
        as ordinary text, never as control tokens. `allowed_special` ("all" or a set of
        strings) lets them through as special tokens; `disallowed_special` makes their
        presence an error instead.
        """
        if not isinstance(s, str):
            raise PromptError(f"Text to encode must be a str, not {type(s).__name__}.")
        allowed = set() if allowed_special is None else allowed_special
        tokens: list[int] = [self.bos_id] if bos else []
        for piece in _pieces(s):
            try:
                tokens += self.model.encode(piece, allowed_special=allowed, disallowed_special=disallowed_special)
            except ValueError as e:
                # tiktoken raises only for a disallowed special token, and names it in quotes.
                found = re.search(r"token '(.*?)'", str(e))
                name = f" {found.group(1)}" if found else ""
                raise PromptError(
                    f"The text contains the special token{name}, which disallowed_special forbids."
                ) from None
        if eos:
            tokens.append(self.eos_id)
        return tokens

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of `tokens` (invalid UTF-8 across a token boundary becomes U+FFFD)."""
        # int() so tensors, numpy arrays and their scalars work too.
        return self.model.decode([int(t) for t in tokens])
