"""What generation streams: per step, one GenerationResult per row."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class GenerationResult:
    token: int
    text: str
    source: str  # "input" (echoed prompt) or "output"
    batch_idx: int
    finished: bool
    ignore_token: bool  # True for rows that already finished
    logprobs: Optional[list[float]] = None
