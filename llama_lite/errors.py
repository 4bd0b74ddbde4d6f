"""Errors a user can cause. Each carries one clear sentence; scripts print it without a traceback."""


class LlamaLiteError(Exception):
    """Base class: a problem with the user's input, files or flags (not a bug)."""


class ConfigError(LlamaLiteError):
    """params.json / config.json missing, malformed or inconsistent."""


class CheckpointError(LlamaLiteError):
    """Checkpoint files missing, truncated, corrupted or incompatible with the run."""


class TokenizerError(LlamaLiteError):
    """Tokenizer file missing or inconsistent with the model."""


class PromptError(LlamaLiteError):
    """A prompt, dialog or generation setting that cannot be served."""
