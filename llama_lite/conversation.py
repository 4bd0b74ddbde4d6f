"""A multi-turn chat that keeps its KV cache between turns: each turn prefills only the new message.

    chat = llama.conversation()
    for step in chat.send("Hello"):        # streams GenerationResults, as Llama4.generate does
        ...
    chat.send_and_wait("And then?")         # the reply as a RawMessage
    chat.reset()                            # forget it all

The conversation is held as the exact tokens the model saw and produced (not re-encoded from text,
which could split differently), so a continued turn gives the tokens a fresh prefill of those
tokens gives. It lives on one row of the cache; any other generation on the same model overwrites
that row (so does another conversation's turn), which the conversation notices
(``Llama4.cache_epoch``) and then prefills afresh.
"""

from typing import Iterator, Optional, Union

from .chat_format import RawMessage
from .errors import PromptError
from .result import GenerationResult


class Conversation:
    def __init__(self, llama, system: Optional[str] = None):
        self.llama = llama
        self.system = system
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (and what the cache holds of it)."""
        self.tokens: list[int] = []  # every token of the conversation so far
        self.images: list[tuple[int, object]] = []  # (index in tokens of its first token, tiles) per image
        self.cached = 0  # how many of them the cache holds (all but the last reply's final token)
        self._epoch: Optional[int] = None
        self._open = False  # the last reply ended without a stop token
        self.last_prefill = 0  # tokens prefilled by the latest turn

    def _encode_turn(self, message: RawMessage) -> tuple[list[int], list, int]:
        """Tokens of the turn, its images' tiles, and where the message's tokens start in it."""
        fmt = self.llama.formatter
        head: list[int] = []
        if not self.tokens:
            head = [self.llama.tokenizer.bos_id]
            if self.system is not None:
                head += fmt.encode_message(RawMessage(role="system", content=self.system))
        dialog = fmt.encode_dialog([message])  # BOS, the message, the assistant header
        return head + dialog.tokens[1:], [image.tiles for image in dialog.images], len(head)

    def _prompt(self, message: RawMessage) -> tuple[list[int], list[tuple[int, object]]]:
        # A reply cut short (max_gen_len, max_seq_len or the caller) gets its turn closed as the chat format does.
        closing = [self.llama.tokenizer.eot_id] if self._open else []
        turn, tiles, _ = self._encode_turn(message)
        at = len(self.tokens) + len(closing)
        # the turn's images are ordered as their <|patch|> runs; only their first token's index matters
        return self.tokens + closing + turn, self.images + [(at, t) for t in tiles]

    def prompt_with(self, message: Union[str, RawMessage]) -> list[int]:
        """Every token of the conversation with ``message`` added: what a fresh prefill would take."""
        if isinstance(message, str):
            message = RawMessage(role="user", content=message)
        return self._prompt(message)[0]

    def send(self, message: Union[str, RawMessage], **sampling) -> Iterator[list[GenerationResult]]:
        """Add a user message (text or a RawMessage) and stream the reply; ``sampling`` as for ``generate``.

        The reply joins the conversation as it streams, also when the caller stops early.
        """
        if isinstance(message, str):
            message = RawMessage(role="user", content=message)
        for key in ("start_pos", "echo"):
            if key in sampling:
                raise PromptError(f"{key} cannot be set for a conversation turn")
        full, images = self._prompt(message)
        cached = self.cached if self._epoch == self.llama.cache_epoch else 0
        new = full[cached:]
        # images whose patches are prefilled now (all of them after a fresh start; else the new turn's)
        fresh = [tiles for at, tiles in images if at >= cached]
        steps = self.llama.generate([new], start_pos=[cached], images=[fresh] if fresh else None, **sampling)
        stops = set(self.llama.tokenizer.stop_tokens)
        reply: list[int] = []
        try:
            for step in steps:
                r = step[0]
                if r.source == "output" and not r.ignore_token:
                    if not reply:
                        # Tell any other conversation on this model that row 0 is no longer its own.
                        self.llama.cache_epoch += 1
                        self._epoch, self.last_prefill = self.llama.cache_epoch, len(new)
                    reply.append(r.token)
                    # Generation feeds every yielded token back into the cache except the last one.
                    self.tokens, self.cached = full + reply, len(full) + len(reply) - 1
                    self.images = images
                    self._open = r.token not in stops
                yield step
        except Exception:
            if not reply:
                # Refused (too long for max_seq_len) or failed in the prefill, which may have
                # overwritten part of the row: the turn is dropped and the next one prefills afresh.
                self._epoch, self.cached = None, 0
            raise

    def send_and_wait(self, message: Union[str, RawMessage], **sampling) -> RawMessage:
        """The reply to ``message`` as a RawMessage (after the whole reply is generated)."""
        stops = set(self.llama.tokenizer.stop_tokens)
        tokens, reason = [], "out_of_tokens"
        for step in self.send(message, **sampling):
            r = step[0]
            if r.source != "output" or r.ignore_token:
                continue
            if r.token in stops:
                reason = "end_of_message" if r.token == self.llama.tokenizer.eom_id else "end_of_turn"
            else:
                tokens.append(r.token)
        return self.llama.formatter.decode_assistant_message(tokens, reason)
