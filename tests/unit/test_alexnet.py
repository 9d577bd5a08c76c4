"""AlexNet: the paper's layer shapes and parameter count, the CPU-scaled variant, configs."""

import pytest
import torch
import torch.nn.functional as F

from scaleout.api import build_job, config_from_dict
from scaleout.data.images import write_image_folder
from scaleout.nn import build_model
from scaleout.nn.models import AlexNet


def paper_parameter_count(num_classes: int = 1000, towers: int = 2) -> int:
    """Krizhevsky et al. 2012, section 3.5 / figure 2: kernels 96 of 11x11x3, 256 of
    5x5x48, 384 of 3x3x256, 384 of 3x3x192, 256 of 3x3x192 (the input depth of conv2, 4, 5
    is split over the two GPUs), fully connected 4096, 4096 on 6x6x256 features, softmax."""
    split = towers  # towers = 1: every kernel sees its whole input
    convs = [
        (96, 11 * 11 * 3),
        (256, 5 * 5 * 96 // split),
        (384, 3 * 3 * 256),
        (384, 3 * 3 * 384 // split),
        (256, 3 * 3 * 384 // split),
    ]
    fcs = [(4096, 6 * 6 * 256), (4096, 4096), (num_classes, 4096)]
    return sum(out * (fan_in + 1) for out, fan_in in convs + fcs)


def test_paper_alexnet_has_the_papers_parameters():
    assert paper_parameter_count() == 60_965_224  # "60 million parameters"
    with torch.device("meta"):
        model = build_model("alexnet")
        joined = build_model("alexnet", groups=1)
    assert sum(p.numel() for p in model.parameters()) == paper_parameter_count()
    assert sum(p.numel() for p in joined.parameters()) == paper_parameter_count(towers=1)
    assert model.input_shape == (3, 227, 227)
    layers = dict(model.features.named_children())
    assert sum(isinstance(m, torch.nn.Conv2d) for m in layers.values()) == 5
    assert sum(isinstance(m, torch.nn.MaxPool2d) for m in layers.values()) == 3
    assert [m.p for m in model.classifier if isinstance(m, torch.nn.Dropout)] == [0.5, 0.5]


def test_paper_alexnet_feature_map_sizes():
    model = AlexNet()
    sizes = {}
    for name in ("conv1", "pool1", "conv2", "pool2", "conv5", "pool5"):
        getattr(model.features, name).register_forward_hook(
            lambda m, i, out, name=name: sizes.__setitem__(name, tuple(out.shape[1:]))
        )
    with torch.no_grad():
        logits = model.eval()(torch.randn(1, 3, 227, 227))
    assert logits.shape == (1, 1000)
    assert sizes == {
        "conv1": (96, 55, 55),
        "pool1": (96, 27, 27),
        "conv2": (256, 27, 27),
        "pool2": (256, 13, 13),
        "conv5": (256, 13, 13),
        "pool5": (256, 6, 6),
    }


def test_small_alexnet_learns_a_few_images():
    torch.manual_seed(0)
    model = build_model("alexnet_small", num_classes=4, dropout=0.0)
    assert model.input_shape == (3, 64, 64)
    x, y = torch.randn(8, 3, 64, 64), torch.arange(8) % 4
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared: no oversubscription
    try:
        losses = []
        for _ in range(20):
            loss = F.cross_entropy(model(x), y)
            losses.append(loss.item())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    assert losses[0] == pytest.approx(torch.log(torch.tensor(4.0)).item(), abs=0.1)
    assert losses[-1] < 0.1 * losses[0]


def test_too_small_input_is_a_clear_error():
    with pytest.raises(ValueError, match="input_size = 32 is too small"):
        AlexNet(input_size=32)


def test_config_builds_small_alexnet_on_an_image_folder(tmp_path):
    write_image_folder(tmp_path, num_classes=5, num_train=10, num_test=5, size=72)
    config = config_from_dict(
        {
            "data": {"dataset": "image_folder", "path": str(tmp_path), "crop": 64},
            "model": {"kind": "alexnet_small", "num_classes": 5, "width": 0.5},
        }
    )
    job = build_job(config)
    train, test = job.build_data()
    model = job.build_model(train)
    assert train[0][0].shape == test[0][0].shape == (3, 64, 64)
    assert model(train.__getitems__([0, 1])[0]).shape == (2, 5)
