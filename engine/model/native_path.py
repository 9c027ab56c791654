"""Which CPU path a loaded model takes, chosen once when it loads (``bind``, called by loader.load_model):
each RMSNorm and int8 matrix gets the native kernels or none, and the decoder stack its native decode step
or none. Nothing is decided again per call; a module left unbound takes the torch path, which stays the
reference. ``bind`` returns what to log and report (TelemetrySnapshot.native_path, .native_reason)."""

from __future__ import annotations

from engine.kernels.native import library
from engine.kernels.native.library import NativeStatus
from engine.model.llama import LlamaForCausalLM, RMSNorm
from engine.model.native_decode import decoder_for
from engine.model.weights import Int8Linear


def bind(model: LlamaForCausalLM) -> NativeStatus:
    """Point ``model``'s modules at the native kernels (or at none) and say which path it takes and why."""
    on_cpu = model.model.norm.weight.device.type == "cpu"
    kernels = library.library() if on_cpu else None
    for module in model.modules():
        if isinstance(module, RMSNorm | Int8Linear):
            module.native = kernels
    model.model.native, decode = decoder_for(model.model, kernels)
    if not on_cpu:
        return NativeStatus("off", "the model runs on a GPU")
    status = library.status()
    return NativeStatus(status.path, f"{status.reason}; decode step {decode}")
