"""Hugging Face quantized folders as sources of weights for the quantized loader.

A folder whose config.json carries ``quantization_config`` is read by the module of its
``quant_method``: ``compressed_tensors`` (what llm-compressor writes and vLLM serves) or
``fbgemm_fp8`` (transformers' format of Meta's FP8 Maverick). Each gives the loader whole
weights under llama-lite's names, mapped onto llama-lite's formats without re-quantizing.
"""

import json
from pathlib import Path
from typing import Optional

from llama_lite.errors import CheckpointError

SOURCES = ("compressed-tensors", "fbgemm_fp8")


def hf_quantization_config(ckpt_dir) -> Optional[dict]:
    """config.json's ``quantization_config`` (the text config's, for a multimodal folder), or None."""
    path = Path(ckpt_dir).expanduser() / "config.json"
    if not path.is_file() or (path.parent / "params.json").is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # the core reports a malformed config.json in its own words
    if not isinstance(cfg, dict):
        return None
    q = cfg.get("quantization_config")
    if q is None and isinstance(cfg.get("text_config"), dict):
        q = cfg["text_config"].get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{path}: quantization_config must be a JSON object")
    method = q.get("quant_method")
    if method not in SOURCES:
        raise CheckpointError(
            f"{path} is quantized with quant_method {method!r}, which llama-lite cannot load "
            f"(it reads {' and '.join(SOURCES)})"
        )
    return q


def open_hf_source(checkpoint, mode, quantization_config: dict):
    """The source object for a Hugging Face quantized folder (see ``hf.HFQuantizedSource``)."""
    if quantization_config["quant_method"] == "fbgemm_fp8":
        from .fbgemm_fp8 import FbgemmFp8Source

        return FbgemmFp8Source(checkpoint, mode, quantization_config)
    from .compressed_tensors import CompressedTensorsSource

    return CompressedTensorsSource(checkpoint, mode, quantization_config)
