"""llama-lite: a minimal Llama 4 inference engine."""

from .args import ModelArgs, MoEArgs, VisionArgs
from .chat_format import ChatFormat, RawMediaItem, RawMessage, RawTextItem, ToolCall
from .checkpoint import Checkpoint
from .conversation import Conversation
from .errors import CheckpointError, ConfigError, LlamaLiteError, PromptError, TokenizerError
from .generation import Llama4
from .result import GenerationResult
from .model import Transformer
from .tokenizer import Tokenizer

__all__ = [
    "ChatFormat", "Checkpoint", "CheckpointError", "ConfigError", "GenerationResult", "Llama4", "LlamaLiteError",
    "Conversation", "ModelArgs", "MoEArgs", "PromptError", "RawMediaItem", "RawMessage", "RawTextItem", "Tokenizer",
    "TokenizerError", "ToolCall", "Transformer", "VisionArgs",
]
