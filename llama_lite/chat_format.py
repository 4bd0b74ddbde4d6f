"""Llama 4 chat prompt format (text and images) and parsing of the assistant's replies.

A message is `<|header_start|>{role}<|header_end|>\\n\\n{content}` closed by `<|eot|>` (end of
turn) or `<|eom|>` (end of message: the assistant called a tool and waits for its result).
An image in the content becomes `<|image_start|>`, a run of `<|patch|>` tokens per tile (tiles
separated by `<|tile_x_separator|>` within a row and `<|tile_y_separator|>` after each row), then
`<|image|>` and the thumbnail's run, and `<|image_end|>`; the model puts the image's patch
embeddings in place of the `<|patch|>` tokens. Token ids equal those of Meta's reference
(`llama_models.llama4.chat_format`).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from llama_lite.args import VisionArgs
from llama_lite.errors import PromptError
from llama_lite.image_transform import TransformedImage, load_image, transform_image
from llama_lite.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "ipython")
# Callers coming from the OpenAI / llama-stack vocabulary say "tool" for tool results;
# the model was trained with the header "ipython".
ROLE_ALIASES = {"tool": "ipython"}
STOP_REASONS = ("end_of_turn", "end_of_message", "out_of_tokens")
TOOL_PROMPT_FORMATS = ("json", "function_tag", "python_list")

# Tools the model was trained to call with `name.call(query="...")` (or raw code for the
# interpreter) rather than with a JSON function call.
BUILTIN_TOOLS = ("brave_search", "wolfram_alpha", "photogen", "code_interpreter")

_BUILTIN_CALL_RE = re.compile(r'\b(?P<tool_name>\w+)\.call\(query="(?P<query>[^"]*)"\)')
_FUNCTION_TAG_RE = re.compile(r"<function=(?P<function_name>[^}]+)>(?P<args>{.*?})")


@dataclass
class ToolCall:
    call_id: str
    tool_name: str
    arguments: dict[str, Any]


@dataclass
class RawTextItem:
    text: str


@dataclass
class RawMediaItem:
    """An image: bytes of an image file, a file path, a binary file object or a PIL image."""

    data: Any
    type: str = "image"


@dataclass
class RawMessage:
    role: str
    content: str | RawTextItem | RawMediaItem | list[RawTextItem | RawMediaItem]
    stop_reason: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.role, str):
            self.role = ROLE_ALIASES.get(self.role, self.role)
        _check_message(self)


def _check_message(message: Any) -> None:
    if not isinstance(message, RawMessage):
        raise PromptError(f"A dialog message must be a RawMessage, not {type(message).__name__}.")
    role = ROLE_ALIASES.get(message.role, message.role) if isinstance(message.role, str) else message.role
    if role not in ROLES:
        raise PromptError(f"Unknown message role {message.role!r}: expected one of {', '.join(ROLES)} (or tool).")
    items = message.content if isinstance(message.content, list) else [message.content]
    for item in items:
        if isinstance(message.content, list) and isinstance(item, str):
            raise PromptError("Items of a message's content list must be RawTextItem or RawMediaItem, not str.")
        if isinstance(item, RawMediaItem) and item.type != "image":
            raise PromptError(f"Unknown media type {item.type!r}: only images are supported.")
        if isinstance(item, RawTextItem) and not isinstance(item.text, str):
            raise PromptError(f"RawTextItem.text must be a str, not {type(item.text).__name__}.")
        if not isinstance(item, (str, RawTextItem, RawMediaItem)):
            raise PromptError(
                f"Message content must be a str, a RawTextItem, a RawMediaItem or a list of them, not "
                f"{type(item).__name__}."
            )
    if message.stop_reason is not None and message.stop_reason not in STOP_REASONS:
        raise PromptError(
            f"Unknown stop reason {message.stop_reason!r}: expected one of {', '.join(STOP_REASONS)}."
        )
    calls = message.tool_calls
    if not isinstance(calls, list) or not all(
        isinstance(c, ToolCall) and isinstance(c.tool_name, str) and isinstance(c.arguments, dict) for c in calls
    ):
        raise PromptError("tool_calls must be a list of ToolCall, each with a str tool_name and a dict of arguments.")


def _check_tool_prompt_format(tool_prompt_format: str) -> None:
    if tool_prompt_format not in TOOL_PROMPT_FORMATS:
        raise PromptError(
            f"Unknown tool prompt format {tool_prompt_format!r}: expected one of {', '.join(TOOL_PROMPT_FORMATS)}."
        )


def _python_literal(value: Any) -> str:
    # Mirrors the reference's python_list rendering, quirks included (strings are not
    # escaped; dicts render as {k=v}); the model saw exactly this form in training.
    if isinstance(value, str):
        return f'"{value}"'
    if value is None or isinstance(value, (int, float, bool)):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_python_literal(v)}" for k, v in value.items()) + "}"
    raise PromptError(f"A tool-call argument of type {type(value).__name__} cannot be written in python_list format.")


def render_tool_call(call: ToolCall, tool_prompt_format: str = "json") -> str:
    """The text the assistant emits for `call`."""
    _check_tool_prompt_format(tool_prompt_format)
    name, args = call.tool_name, call.arguments
    try:
        if name in ("brave_search", "wolfram_alpha", "photogen"):
            return f'{name}.call(query="{args["query"]}")'
        if name == "code_interpreter":
            return args["code"]
    except KeyError as e:
        raise PromptError(f"A {name} tool call needs a {e.args[0]!r} argument.") from None
    try:
        if tool_prompt_format == "json":
            return json.dumps({"type": "function", "name": name, "parameters": args})
        if tool_prompt_format == "function_tag":
            return f"<function={name}>{json.dumps(args)}</function>"
    except (TypeError, ValueError) as e:
        raise PromptError(f"The arguments of tool call {name!r} cannot be written as JSON: {e}.") from None
    rendered = ", ".join(f"{k}={_python_literal(v)}" for k, v in args.items())
    return f"[{name}({rendered})]"  # python_list


# --- Reading tool calls out of the assistant's text -------------------------------------
# Each parser returns None when the text is not that kind of call.


def _parse_json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _parse_python_call_list(text: str) -> tuple[str, dict] | None:
    """`[f(a=1, b="x"), g(...)]` -> the first call (the format allows several; the model is
    served one at a time). Only keyword arguments with literal values qualify."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return None
    calls = tree.body[0].value
    if not isinstance(calls, ast.List) or not calls.elts:
        return None
    parsed = []
    for node in calls.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        parsed.append((node.func.id, args))
    return parsed[0]


def _parse_custom_call(text: str) -> tuple[str | None, dict | None] | None:
    """A function call in one of the custom-tool forms, searched in this order:
    `<function=name>{json}` anywhere in the text; the whole text a JSON object with "name"
    (or "type": "function") and "parameters"; the whole text a python call list.

    Returns (name, arguments), or (None, None) for a JSON object that claims to be a call but
    is malformed (the text is then kept as plain content), or None for no custom call."""
    tag = _FUNCTION_TAG_RE.search(text)
    if tag is not None:
        # Models often write single-quoted pseudo-JSON; the reference accepts it this way.
        args = _parse_json_object(tag.group("args").replace("'", '"'))
        return None if args is None else (tag.group("function_name"), args)
    obj = _parse_json_object(text)
    if obj is not None:
        if obj.get("type") != "function" and "name" not in obj:
            return None
        name, args = obj.get("name"), obj.get("parameters")
        if isinstance(name, str) and isinstance(args, dict):
            return name, args
        return None, None
    return _parse_python_call_list(text)


def parse_assistant_content(content: str, stop_reason: str | None) -> RawMessage:
    """The reply as a RawMessage: header and end marker removed, tool call (if any) parsed."""
    content = content.strip(" ")
    header = "<|header_start|>assistant<|header_end|>\n\n"
    if content.startswith(header):
        content = content[len(header) :]

    is_code = content.startswith("<|python_start|>")
    if is_code:
        content = content[len("<|python_start|>") :].replace("<|python_end|>", "")

    # The marker the model ended on is the truth about why it stopped.
    if content.endswith("<|eot|>"):
        content, stop_reason = content[: -len("<|eot|>")], "end_of_turn"
    elif content.endswith("<|eom|>"):
        content, stop_reason = content[: -len("<|eom|>")], "end_of_message"

    name: str | None = None
    args: dict | None = None
    custom = _parse_custom_call(content)
    if custom is not None:
        name, args = custom
        # The model sometimes calls a builtin tool in custom-call form; builtins take a
        # single query, so the first argument value becomes it.
        if name in BUILTIN_TOOLS and args:
            args = {"query": next(iter(args.values()))}
    elif (builtin := _BUILTIN_CALL_RE.search(content)) is not None:
        name, args = builtin.group("tool_name"), {"query": builtin.group("query")}
    elif is_code:
        name, args = "code_interpreter", {"code": content}

    tool_calls = []
    if name is not None and args is not None:
        tool_calls.append(ToolCall(call_id=str(uuid.uuid4()), tool_name=name, arguments=args))
        content = ""
    return RawMessage(role="assistant", content=content, stop_reason=stop_reason, tool_calls=tool_calls)


def content_text(content) -> str:
    """The content as text, an image shown as ``<image>`` (for printing a dialog)."""
    items = content if isinstance(content, list) else [content]
    return "".join(i if isinstance(i, str) else i.text if isinstance(i, RawTextItem) else "<image>" for i in items)


@dataclass
class DialogInput:
    """A prompt's tokens and its images' tiles, in the order of their ``<|patch|>`` runs."""

    tokens: list[int]
    images: list[TransformedImage] = field(default_factory=list)


class ChatFormat:
    """Turns dialogs into prompt tokens (and image tiles) and generated tokens back into messages.

    ``vision_args``: the model's vision tower; without it a dialog with an image is refused.
    ``max_num_chunks``: most tiles an image is cut into (the thumbnail not counted), as the reference's 16.
    """

    def __init__(self, tokenizer: Tokenizer, vision_args: VisionArgs | None = None, max_num_chunks: int = 16):
        self.tokenizer = tokenizer
        self.vision_args = vision_args
        self.max_num_chunks = max_num_chunks

    def _text(self, text: str) -> list[int]:
        # Default encode arguments: special-token strings in user text stay plain text.
        return self.tokenizer.encode(text, bos=False, eos=False)

    def encode_header(self, role: str) -> list[int]:
        special = self.tokenizer.special_tokens
        role = ROLE_ALIASES.get(role, role)
        if role not in ROLES:
            raise PromptError(f"Unknown message role {role!r}: expected one of {', '.join(ROLES)} (or tool).")
        return [special["<|header_start|>"], *self._text(role), special["<|header_end|>"], *self._text("\n\n")]

    def encode_content(self, text: str) -> list[int]:
        """A plain completion prompt: BOS + text, no chat framing."""
        if not isinstance(text, str):
            raise PromptError(f"A completion prompt must be a str, not {type(text).__name__}.")
        return self.tokenizer.encode(text, bos=True, eos=False)

    def image_tokens(self, image: TransformedImage) -> list[int]:
        special, v = self.tokenizer.special_tokens, self.vision_args
        patches = [special["<|patch|>"]] * v.patches_per_tile
        tokens = [special["<|image_start|>"]]
        if image.tiles.shape[0] > 1:
            rows, cols = image.grid
            for _ in range(rows):
                for c in range(cols):
                    tokens += patches + ([special["<|tile_x_separator|>"]] if c < cols - 1 else [])
                tokens.append(special["<|tile_y_separator|>"])
        return tokens + [special["<|image|>"], *patches, special["<|image_end|>"]]

    def encode_image(self, data) -> tuple[list[int], TransformedImage]:
        """Tokens and tiles of one image (bytes, a file path, a file object or a PIL image)."""
        if self.vision_args is None:
            raise PromptError("This model has no vision tower, so it cannot read images (its config has no vision_args).")
        image = transform_image(load_image(data), self.vision_args.image_size, self.max_num_chunks)
        return self.image_tokens(image), image

    def _encode_content(self, content) -> tuple[list[int], list[TransformedImage]]:
        tokens: list[int] = []
        images: list[TransformedImage] = []
        for item in content if isinstance(content, list) else [content]:
            if isinstance(item, RawMediaItem):
                toks, image = self.encode_image(item.data)
                tokens += toks
                images.append(image)
            else:  # each text item is encoded on its own, as the reference does
                tokens += self._text(item.text if isinstance(item, RawTextItem) else item)
        return tokens, images

    def encode_message(self, message: RawMessage, tool_prompt_format: str = "json") -> list[int]:
        return self._encode_message(message, tool_prompt_format)[0]

    def _encode_message(self, message: RawMessage, tool_prompt_format: str) -> tuple[list[int], list[TransformedImage]]:
        _check_message(message)
        _check_tool_prompt_format(tool_prompt_format)
        role = ROLE_ALIASES.get(message.role, message.role)
        tokens = self.encode_header(role)
        content, images = self._encode_content(message.content)
        tokens += content
        ends_message = role == "ipython"
        if role == "assistant":
            for call in message.tool_calls:
                tokens += self._text(render_tool_call(call, tool_prompt_format))
            # A tool call leaves the turn open: the tool's result comes next, then the model
            # continues.
            ends_message = message.stop_reason == "end_of_message" or bool(message.tool_calls)
        tokens.append(self.tokenizer.special_tokens["<|eom|>" if ends_message else "<|eot|>"])
        return tokens, images

    def encode_dialog_prompt(self, messages: list[RawMessage], tool_prompt_format: str = "json") -> list[int]:
        """BOS, every message, then an open assistant header for the model to complete (tokens only;
        ``encode_dialog`` also gives the images' tiles)."""
        return self.encode_dialog(messages, tool_prompt_format).tokens

    def encode_dialog(self, messages: list[RawMessage], tool_prompt_format: str = "json") -> DialogInput:
        """The prompt of ``encode_dialog_prompt`` with the tiles of every image in it."""
        if isinstance(messages, (str, bytes, RawMessage)) or not hasattr(messages, "__iter__"):
            raise PromptError("A dialog must be a list of RawMessage.")
        messages = list(messages)
        if not messages:
            raise PromptError("A dialog must contain at least one message.")
        _check_tool_prompt_format(tool_prompt_format)
        tokens, images = [self.tokenizer.bos_id], []
        for message in messages:
            toks, imgs = self._encode_message(message, tool_prompt_format)
            tokens += toks
            images += imgs
        tokens += self.encode_header("assistant")
        return DialogInput(tokens, images)

    def decode_assistant_message(self, tokens: list[int], stop_reason: str | None) -> RawMessage:
        return self.decode_assistant_message_from_content(self.tokenizer.decode(tokens), stop_reason)

    def decode_assistant_message_from_content(self, content: str, stop_reason: str | None) -> RawMessage:
        if stop_reason is not None and stop_reason not in STOP_REASONS:
            raise PromptError(f"Unknown stop reason {stop_reason!r}: expected one of {', '.join(STOP_REASONS)}.")
        return parse_assistant_content(content, stop_reason)
