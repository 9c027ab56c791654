"""The Llama/Qwen2-family decoder, its config, the weight loaders and the built-in tiny model."""

from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "ModelConfig", "ModelLoadError", "load_model"]
