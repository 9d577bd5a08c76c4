"""Checkpoints: exact round trips, atomic writes, and refusal of corrupted files."""

import json

import pytest
import torch

from scaleout.checkpoint import (
    CheckpointDir,
    atomic_write,
    load_checkpoint,
    load_optimizer_state,
    optimizer_state,
    save_checkpoint,
)
from scaleout.errors import CheckpointError


def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(5, 3, generator=g),
        "b": torch.arange(4, dtype=torch.int64),
        "s": torch.tensor(2.5),
        "h": torch.randn(7, generator=g).half(),
    }


def test_round_trip_is_exact(tmp_path):
    original = tensors()
    path = save_checkpoint(tmp_path / "c", original, {"step": 3, "lr": 0.1, "t": (1, 2)})
    assert path == tmp_path / "c.json"
    loaded, meta = load_checkpoint(path)
    assert meta == {"step": 3, "lr": 0.1, "t": [1, 2]}
    assert loaded.keys() == original.keys()
    for name, value in original.items():
        assert torch.equal(loaded[name], value) and loaded[name].dtype == value.dtype
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("which", ["safetensors", "json"])
def test_flipped_byte_is_refused(tmp_path, which):
    path = save_checkpoint(tmp_path / "c", tensors(), {"step": 500, "note": "x" * 50})
    target = tmp_path / f"c.{which}"
    data = bytearray(target.read_bytes())
    # Flip a byte in the payload: the tensor data, or a digit of the step in the metadata.
    index = len(data) - 5 if which == "safetensors" else data.index(b"500") + 2
    data[index] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(path)


def test_truncated_and_missing_files(tmp_path):
    path = save_checkpoint(tmp_path / "c", tensors(), {})
    tensor_file = tmp_path / "c.safetensors"
    tensor_file.write_bytes(tensor_file.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(path)
    tensor_file.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(path)
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable JSON"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "absent.json")


def test_atomic_write_keeps_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")

    def fail(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        atomic_write(target, fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "rmsprop", "adam"])
def test_optimizer_state_round_trip_continues_identically(tmp_path, name):
    """Save after 3 steps, restore into a fresh optimizer: the next steps match exactly."""

    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        kinds = {
            "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
            "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
            "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
            "adam": lambda p: torch.optim.Adam(p, lr=0.01),
        }
        return model, kinds[name](model.parameters())

    def steps(model, opt, seeds):
        for seed in seeds:
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    reference, ref_opt = make()
    steps(reference, ref_opt, range(6))

    model, opt = make()
    steps(model, opt, range(3))
    optim_tensors, optim_meta = optimizer_state(opt)
    weights = {f"model.{k}": v for k, v in model.state_dict().items()}
    path = save_checkpoint(tmp_path / "c", {**weights, **optim_tensors}, {"opt": optim_meta})

    restored, restored_opt = make()
    loaded, meta = load_checkpoint(path)
    restored.load_state_dict({k[6:]: v for k, v in loaded.items() if k.startswith("model.")})
    load_optimizer_state(restored_opt, loaded, meta["opt"])
    steps(restored, restored_opt, range(3, 6))
    for a, b in zip(reference.parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_dir_keeps_newest(tmp_path):
    directory = CheckpointDir(tmp_path / "ck", keep=2)
    assert directory.latest() is None
    for step in (10, 20, 30):
        directory.save(step, {"x": torch.tensor([float(step)])}, {"step": step})
    assert directory.steps() == [20, 30]
    assert directory.latest() == tmp_path / "ck" / "step_00000030.json"
    assert len(list((tmp_path / "ck").glob("*.safetensors"))) == 2
    sidecar = json.loads(directory.latest().read_text())
    assert sidecar["meta"]["step"] == 30 and len(sidecar["sha256"]) == 64
