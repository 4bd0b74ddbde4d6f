"""llama-lite: a minimal Llama 4 inference engine."""

from .args import ModelArgs, MoEArgs
from .chat_format import ChatFormat, RawMessage, ToolCall
from .checkpoint import Checkpoint
from .conversation import Conversation
from .errors import CheckpointError, ConfigError, LlamaLiteError, PromptError, TokenizerError
from .generation import GenerationResult, Llama4
from .model import Transformer
from .tokenizer import Tokenizer

__all__ = [
    "ChatFormat", "Checkpoint", "CheckpointError", "ConfigError", "GenerationResult", "Llama4", "LlamaLiteError",
    "Conversation", "ModelArgs", "MoEArgs", "PromptError", "RawMessage", "Tokenizer", "TokenizerError", "ToolCall",
    "Transformer",
]
