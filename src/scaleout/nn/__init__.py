"""Single-process model code: layers, models, losses (pure PyTorch, no communication)."""

# autoencoder registers the model kind "sparse_autoencoder" in MODELS when imported.
from scaleout.nn.autoencoder import SparseAutoencoderNetwork, SparseAutoencoderStack
from scaleout.nn.local import L2Pool2d, LocalContrastNorm2d, LocalGeometry, LocallyConnected2d
from scaleout.nn.models import MLP, MODELS, build_model, register_model, speech_dnn

__all__ = [
    "MLP",
    "MODELS",
    "L2Pool2d",
    "LocalContrastNorm2d",
    "LocalGeometry",
    "LocallyConnected2d",
    "SparseAutoencoderNetwork",
    "SparseAutoencoderStack",
    "build_model",
    "register_model",
    "speech_dnn",
]
