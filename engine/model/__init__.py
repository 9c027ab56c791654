"""The Llama/Qwen2-family decoder, its config, weight loader, tokenizers and the built-in tiny model."""

from engine.model.config import ModelConfig
from engine.model.detokenizer import IncrementalDetokenizer
from engine.model.errors import ModelLoadError
from engine.model.loader import LoadedModel, load_model
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "Tokenizer",
    "load_model",
]
