"""Shared fixtures: one embedded Ray instance for the tests that need it, and processes a
test stops (SIGSTOP) that must not outlive it. Data sets the repository does not ship
(Fashion-MNIST) are read from the workplace's shared copy when `$SCALEOUT_DATA` is unset."""

import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
if SHARED_DATA.is_dir():
    os.environ.setdefault("SCALEOUT_DATA", str(SHARED_DATA))


@pytest.fixture(scope="session")
def ray_session():
    """An embedded Ray instance, started on first use and shut down after the last test."""
    from scaleout.runtime import session

    with session() as runtime:
        yield runtime


@pytest.fixture
def stopped_pids():
    """A list for the PIDs a test SIGSTOPs; each is SIGKILLed when the test ends (a stopped
    process the run did not end itself would stay behind, holding its memory)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def in_the_repository(monkeypatch):
    """The repository as the working directory: Ray's workers import `examples` and
    `tests.*` from it."""
    monkeypatch.chdir(REPO)


@pytest.fixture
def one_thread():
    """One torch thread for the test: on small tensors OpenMP's synchronisation dominates,
    and varies wildly when other work shares the machine's cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def pixel_sets(tmp_path):
    """The same uint8 images as PNG files and .npy arrays under `tmp_path`, and the arrays."""
    from tests.pixel_sets import write_pixel_sets

    return write_pixel_sets(tmp_path)


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """An ImageFolder of 3 classes, 24 training and 6 test images of 20 x 20 pixels."""
    from scaleout.data.images import write_image_folder

    root = tmp_path_factory.mktemp("images")
    return write_image_folder(root, num_classes=3, num_train=24, num_test=6, size=20)


@pytest.fixture
def previous(tmp_path) -> tuple[Path, dict[str, bytes]]:
    """A finished tiny run (checkpoints at steps 10 and 20) and its files."""
    import scaleout
    from tests.tiny_run import config, files

    result = scaleout.fit(config(tmp_path))
    assert result.step == 20
    run = result.run_dir
    assert {"metrics.jsonl", "checkpoints/step_00000020.safetensors"} <= files(run).keys()
    return run, files(run)
