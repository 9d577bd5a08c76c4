"""Models: exact parameter counts from the papers' layer sizes, and the registry."""

import pytest
import torch

from scaleout.nn import MLP, MODELS, build_model, speech_dnn


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_mlp_count_matches_hand_computation():
    model = MLP([784, 1024, 1024, 10], dropout=[0.2, 0.5, 0.5])
    # (784*1024 + 1024) + (1024*1024 + 1024) + (1024*10 + 10)
    assert count(model) == 1_863_690


def test_speech_dnn_count():
    with torch.device("meta"):
        model = speech_dnn()
    expected = (440 * 2560 + 2560) + 3 * (2560 * 2560 + 2560) + (2560 * 8192 + 8192)
    assert count(model) == expected == 41_777_152
    assert model.input_shape == (440,)
    activations = [m for m in model.modules() if isinstance(m, torch.nn.Sigmoid)]
    assert len(activations) == 4


def test_mlp_dropout_placement_and_forward():
    model = MLP([6, 5, 3], activation="tanh", dropout=[0.2, 0.5])
    kinds = [type(m).__name__ for m in model.layers]
    assert kinds == ["Dropout", "Linear", "Tanh", "Dropout", "Linear"]
    assert [m.p for m in model.layers if isinstance(m, torch.nn.Dropout)] == [0.2, 0.5]
    x = torch.randn(4, 1, 2, 3)  # flattened to (4, 6)
    model.eval()
    fc1, fc2 = model.layers[1], model.layers[4]
    expected = fc2(torch.tanh(fc1(x.flatten(1))))
    torch.testing.assert_close(model(x), expected)


def test_registry():
    assert {"mlp", "speech_dnn"} <= set(MODELS)
    assert count(build_model("mlp", sizes=[4, 2])) == 10
    with pytest.raises(ValueError, match="model.kind = 'nope'"):
        build_model("nope")
    with pytest.raises(ValueError, match="model.dropout"):
        MLP([4, 3, 2], dropout=[0.1])
