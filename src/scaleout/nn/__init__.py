"""Single-process model code: layers, models, losses (pure PyTorch, no communication)."""

from scaleout.nn.models import MLP, MODELS, build_model, register_model, speech_dnn

__all__ = ["MLP", "MODELS", "build_model", "register_model", "speech_dnn"]
