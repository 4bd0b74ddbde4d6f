"""Chat with a Llama 4 checkpoint: a few demo dialogs (batched), one message, or an interactive session.

    python -m scripts.chat_completion CKPT                      # the demo dialogs
    python -m scripts.chat_completion CKPT --prompt "Hi there"  # one user message
    python -m scripts.chat_completion CKPT --interactive        # multi-turn, streamed
    python -m scripts.chat_completion CKPT --prompt "Describe it" --image a.png --image b.jpg
    torchrun --nproc-per-node 2 -m scripts.chat_completion CKPT --world_size 2 --interactive

In the interactive session an empty line is ignored, `/image PATH` attaches an image to the next
message, `reset` starts a new conversation, and `exit` or end of input (Ctrl-D) ends it. The
conversation's KV cache is kept between turns, so a turn prefills only its new message. With a
checkpoint that has a vision tower the demo dialogs include one with two (generated) pictures.
"""

from typing import Optional

from llama_lite.chat_format import RawMediaItem, RawMessage, RawTextItem, content_text
from llama_lite.checkpoint import read_model_args
from llama_lite.errors import PromptError
from llama_lite.image_transform import load_image
from scripts.common import (
    build_llama,
    check_flags,
    FlagError,
    check_kv_cache_dtype,
    check_quantization_mode,
    set_kernels,
    parse_dtype,
    path_flag,
    print_error,
    read_line,
    run_cli,
    speed_line,
    stream_text,
    text_flag,
    with_flag_help,
)

DEMO_DIALOGS: list[list[RawMessage]] = [
    [RawMessage(role="user", content="What is the recipe of mayonnaise?")],
    [
        RawMessage(role="user", content="I am going to Paris, what should I see?"),
        RawMessage(
            role="assistant",
            content="Paris has the Eiffel Tower, the Louvre and Notre-Dame; the Seine's banks are lovely for a walk.",
            stop_reason="end_of_turn",
        ),
        RawMessage(role="user", content="What is so great about #1?"),
    ],
    [
        RawMessage(role="system", content="Always answer with Haiku"),
        RawMessage(role="user", content="I am going to Paris, what should I see?"),
    ],
    [
        RawMessage(role="system", content="Always answer with emojis"),
        RawMessage(role="user", content="How to go from Beijing to NY?"),
    ],
]


def image_dialog() -> list[RawMessage]:
    """The demo's two-image dialog, as in Meta's chat_completion example (pictures drawn by scripts.demo_images)."""
    from scripts.demo_images import demo_images

    items = [RawMediaItem(data=img) for img in demo_images()]
    return [RawMessage(role="user", content=[*items, RawTextItem(text="Write a haiku that brings both images together")])]


@with_flag_help
def main(
    checkpoint_dir: str,
    world_size: Optional[int] = None,
    max_seq_len: int = 4096,
    max_batch_size: int = 4,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_gen_len: Optional[int] = None,
    quantization_mode: str = "none",
    prompt: Optional[str] = None,
    image: Optional[list[str]] = None,
    interactive: bool = False,
    seed: int = 1,
    tokenizer_path: Optional[str] = None,
    dtype: str = "bf16",
    kernels: str = "auto",
    kv_cache_dtype: Optional[str] = None,
    compile: Optional[bool] = None,  # noqa: A002 - the flag is --compile
    int8_activations: bool = False,
) -> None:
    """Chat with a Llama 4 model.

    Args:
        {checkpoint_dir}
        {world_size}
        max_seq_len: Longest conversation in tokens (prompt and reply) the KV cache holds.
        max_batch_size: Most dialogs generated together; the demo dialogs run in batches of this size.
        {temperature}
        {top_p}
        max_gen_len: Most tokens in one reply (default: until a stop token or max_seq_len).
        {quantization_mode}
        prompt: One user message to answer instead of the demo dialogs (with --interactive, the first turn).
        image: An image file shown to the model with --prompt (with --interactive, in the first turn); repeat
            the flag for several images. Needs a checkpoint with a vision tower.
        interactive: Multi-turn chat reading one user message per line from stdin, streaming each reply
            and its speed; ends on end of input or a line `exit`.
        {seed}
        {build_flags}
    """
    ckpt = path_flag("checkpoint_dir", checkpoint_dir)
    prompt = text_flag("prompt", prompt)
    mode = check_quantization_mode(quantization_mode)
    check_flags(world_size=world_size, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                temperature=temperature, top_p=top_p, max_gen_len=max_gen_len, seed=seed)
    if prompt == "":
        raise FlagError("--prompt is empty; give the user message to answer")
    images = image_flag(image)
    if images and prompt is None and not interactive:
        raise FlagError("--image goes with --prompt or --interactive; give the message to send with it")
    if images and read_model_args(ckpt).vision_args is None:
        raise FlagError(f"--image needs a checkpoint with a vision tower, and {ckpt} has none (text only)")
    for path in images:
        load_image(path)  # a file that is not an image fails here, before the model loads
    kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
    set_kernels(kernels)
    llama = build_llama(ckpt, mode, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                        world_size=world_size, seed=seed, dtype=parse_dtype(dtype), kv_cache_dtype=kv_cache_dtype, compile=compile,
                        int8_activations=int8_activations,
                        tokenizer_path=None if tokenizer_path is None else path_flag("tokenizer_path", tokenizer_path))
    sampling = dict(temperature=temperature, top_p=top_p, max_gen_len=max_gen_len)
    if interactive:
        chat_loop(llama, sampling, first=prompt, first_images=images)
    elif prompt is not None:
        stream_text(llama, llama.chat_completion([[user_message(prompt, images)]], **sampling))
        print()
    else:
        run_demo(llama, DEMO_DIALOGS + ([image_dialog()] if llama.args.vision_args else []), sampling)


def image_flag(value) -> list[str]:
    """--image's paths: fire gives one value as a str (or a number), repeated flags as a list."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, bool) for v in values):
        raise FlagError("--image needs a path")
    return [str(path_flag("--image", v)) for v in values]


def user_message(text: str, images: list) -> RawMessage:
    """A user turn: the images first, then the text (as Meta's examples order them)."""
    if not images:
        return RawMessage(role="user", content=text)
    return RawMessage(role="user", content=[*(RawMediaItem(data=i) for i in images), RawTextItem(text=text)])


def run_demo(llama, dialogs: list[list[RawMessage]], sampling: dict) -> None:
    """Answer ``dialogs`` in batches of max_batch_size and print each with its reply."""
    size = llama.args.max_batch_size
    for lo in range(0, len(dialogs), size):
        batch = dialogs[lo : lo + size]
        for dialog, reply in zip(batch, reply_all(llama, batch, sampling)):
            for message in dialog:
                print(f"{message.role.capitalize()}: {content_text(message.content)}")
            print(f"> Assistant: {reply.content}")
            for call in reply.tool_calls:
                print(f"> Tool call: {call.tool_name}({call.arguments})")
            print("\n" + "=" * 60 + "\n")


def reply_all(llama, dialogs: list[list[RawMessage]], sampling: dict) -> list[RawMessage]:
    """The assistant's reply to each dialog, generated as one batch."""
    stops = set(llama.tokenizer.stop_tokens)
    tokens: list[list[int]] = [[] for _ in dialogs]
    reasons = ["out_of_tokens"] * len(dialogs)
    for step in llama.chat_completion(dialogs, **sampling):
        for r in step:
            if r.source != "output" or r.ignore_token:
                continue
            if r.token in stops:
                reasons[r.batch_idx] = "end_of_message" if r.token == llama.tokenizer.eom_id else "end_of_turn"
            else:
                tokens[r.batch_idx].append(r.token)
    return [llama.formatter.decode_assistant_message(t, reason) for t, reason in zip(tokens, reasons)]


def chat_loop(llama, sampling: dict, first: Optional[str] = None, first_images: Optional[list] = None) -> None:
    """Multi-turn chat on stdin. Every rank runs it: rank 0 reads each line and broadcasts it.

    The conversation keeps its KV cache between turns, so each turn prefills only the new message.
    """
    chat = llama.conversation()
    pending = first
    images = list(first_images or [])  # attached with /image, sent with the next message
    while True:
        line, pending = (pending, None) if pending is not None else (read_line("user> "), None)
        if line is None:  # end of input
            print()
            return
        text = line.strip()
        if text == "exit":
            return
        if not text:
            continue
        if text == "reset":
            chat.reset()
            images = []
            print("(new conversation)")
            continue
        if text == "/image" or text.startswith("/image "):
            path = text[len("/image"):].strip()
            try:
                if not path:
                    raise PromptError("/image needs a path: /image PATH")
                if llama.args.vision_args is None:
                    raise PromptError("this model has no vision tower, so it cannot read images")
                load_image(path)
            except PromptError as e:
                print_error(str(e))
                continue
            images.append(path)
            print(f"(image {path} attached to your next message)")
            continue
        message, images = user_message(text, images), []
        print("assistant> ", end="", flush=True)
        try:
            tokens, reason, seconds = stream_text(llama, chat.send(message, **sampling))
        except PromptError as e:
            # Keep the session: the turn that does not fit is dropped; the user can go on or reset.
            print()
            print_error(f"{e} (type 'reset' to start a new conversation)")
            continue
        print()
        # The prefill count shows the reuse: the new message, not the whole conversation.
        print(f"{speed_line(len(tokens), seconds)} [{chat.last_prefill} tokens prefilled, {len(chat.tokens)} in the "
              "conversation]", flush=True)


if __name__ == "__main__":
    run_cli(main)
