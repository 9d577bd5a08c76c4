"""Suite `gpu`: the library on a CUDA GPU, beside its CPU references and the papers' GPU figures.

Every CUDA path of the library (the device config, pinned and prefetched batches, the
kernels, the codecs, checkpoints of CUDA state) is written and guarded so that the CPU test
suite passes without a GPU; this suite is where those paths run on one. It needs only the
single-process parts of the library (no Ray), so it runs on a bare GPU machine.

1. Exactness: the three locally connected kernels and the `dynamic8` codec on CUDA tensors
   against the same calls on CPU (largest difference relative to the largest value; the
   codec's 8-bit codes equal).
2. COTS HPC table 1 on this GPU: W x, W^T y and delta x^T as % of an sgemm of the same FLOP
   count (`bench local`'s kernel rows on the GPU; the paper: 82 / 75 / 65% on a GTX 680).
   TF32 is off: fp32 as the paper's sgemm.
3. Ding et al. table 1, the 1-GPU column: seconds per 20 iterations of AlexNet (227 px
   random crops of 256 px JPEG files; batch, optimizer and model from
   configs/alexnet_sync.toml) trained by `scaleout.fit` (strategy "single") on the GPU with
   parallel loading (`loader.workers` = 1, the paper's one loading process, and 8) and
   without (0), and the serial run's compute alone (less the time its steps waited for
   data). Batches travel as uint8 and are finished on the GPU (`loader.uint8`, the default
   on CUDA); one more run with 1 loading process ships float32 batches, as before it; and
   the loading pipeline alone (no model), in the training process and in 1 loader process,
   uint8 and float32, shows what a step waits for. The paper, cuDNN-R2 on a Titan Black:
   32.76 s with and 43.52 s without parallel loading. Its 2-GPU column needs two GPUs.
4. Training: the MNIST demo's MLP by `scaleout.fit` on the GPU and on the CPU, same seed
   and steps: test accuracy of each.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import tomllib
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks import Row, SuiteResult, register_suite
from benchmarks.local import KERNEL_LAYERS, kernel_rows
from benchmarks.papers import DING_TABLE_1
from scaleout.api import build_job, config_from_dict, fit
from scaleout.compress import get as get_codec
from scaleout.data import make_loader
from scaleout.data.images import write_image_folder
from scaleout.data.prefetch import DevicePrefetcher
from scaleout.errors import UserError
from scaleout.metrics import read_metrics
from scaleout.nn.local import local_forward, local_transpose, local_weight_grad
from scaleout.runtime.device import resolve_device

DEVICE = "cuda"
ITERATIONS = 20  # Ding et al.'s table: seconds per 20 iterations
ALEXNET_INTERVALS = 4  # logged intervals of ITERATIONS steps: the first warms up
MNIST_STEPS = 600
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MNIST_CONFIG = CONFIGS / "mnist_single.toml"
ALEXNET_CONFIG = CONFIGS / "alexnet_sync.toml"


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.cpu() - reference).abs().max() / reference.abs().max())


def exactness_rows(rows: list[Row]) -> None:
    """The kernels and the codec on the GPU against the same calls on the CPU."""
    g = KERNEL_LAYERS["4x4x8"]
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(g.weight_shape, generator=generator)
    xt = torch.randn(g.in_height, g.in_width, g.in_channels, 32, generator=generator)
    yt = torch.randn(g.out_height, g.out_width, g.depth, 32, generator=generator)
    cuda = {name: t.to(DEVICE) for name, t in (("w", weight), ("x", xt), ("y", yt))}
    checks = {
        "W x": (local_forward(cuda["x"], cuda["w"], g), local_forward(xt, weight, g)),
        "W^T y": (local_transpose(cuda["y"], cuda["w"], g), local_transpose(yt, weight, g)),
        "delta x^T": (
            local_weight_grad(cuda["y"], cuda["x"], g),
            local_weight_grad(yt, xt, g),
        ),
    }
    for op, (ours, reference) in checks.items():
        rows.append(
            Row(
                f"{op} on {DEVICE} vs cpu",
                _relative_error(ours, reference),
                "max rel. diff",
                "lower",
                target=1e-5,
            )
        )
    codec = get_codec("dynamic8", block_size=4096)
    values = torch.randn(1 << 20, generator=generator)
    on_gpu, on_cpu = codec.encode(values.to(DEVICE)), codec.encode(values)
    codes_differ = int((on_gpu.codes.cpu() != on_cpu.codes).sum())
    rows.append(
        Row(
            f"dynamic8 codes on {DEVICE} unlike cpu's (of 2^20)",
            codes_differ,
            "codes",
            "lower",
            target=0,
        )
    )
    decoded = codec.decode(on_gpu)
    rows.append(
        Row(
            f"dynamic8 decode on {DEVICE} vs cpu",
            _relative_error(decoded, codec.decode(on_cpu)),
            "max rel. diff",
            "lower",
            target=1e-6,
        )
    )


def kernel_speed_rows(rows: list[Row], ratios: dict) -> None:
    """COTS HPC table 1: `bench local`'s kernel rows on the GPU, fp32 without TF32."""
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for name, g in KERNEL_LAYERS.items():
            kernel_rows(name, g, rows, ratios, device=DEVICE)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


def alexnet_config(root: Path, images: Path, loader_workers: int, uint8: bool) -> dict:
    """configs/alexnet_sync.toml (the paper's batch, optimizer and model) as one process on
    the GPU reading `images`, logging every ITERATIONS steps."""
    with ALEXNET_CONFIG.open("rb") as file:
        config = tomllib.load(file)
    steps = ITERATIONS * ALEXNET_INTERVALS
    config.pop("sync")
    config["run"] |= {
        "name": f"alexnet_{loader_workers}_{'uint8' if uint8 else 'float'}",
        "out_dir": str(root),
        "device": DEVICE,
        "num_threads": None,  # the config's 1 is per CPU worker
    }
    config["data"] = {"dataset": "image_folder", "path": str(images)}
    config["data"] |= {"image_size": 256, "crop": 227}  # Krizhevsky et al.'s crops
    config["loader"] = {"workers": loader_workers, "uint8": uint8}
    config["train"] |= {
        "strategy": "single",
        "steps": steps,
        "log_every": ITERATIONS,
        "eval_every": steps,
        "checkpoint_every": steps,
    }
    return config


def _alexnet(
    root: Path, images: Path, loader_workers: int, uint8: bool
) -> tuple[list[float], list[float]]:
    """`scaleout.fit` of AlexNet on the GPU: seconds per ITERATIONS steps of each logged
    interval after the first, and the seconds of each that the steps waited for data."""
    config = alexnet_config(root, images, loader_workers, uint8)
    result = fit(config, overwrite=True)
    assert result.run_dir is not None
    lines = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "examples_per_s" in r]
    lines = lines[1:]  # warm-up: cuDNN's autotuning, the loader's start
    batch = config["train"]["batch_size"]
    seconds = [ITERATIONS * batch / r["examples_per_s"] for r in lines]
    waited = [ITERATIONS * r.get("data_wait_s", 0.0) for r in lines]
    return seconds, waited


def _loading_alone(config: dict) -> float:
    """Seconds per ITERATIONS batches of the run's own loading pipeline without a model:
    loader processes, pinned memory, the transfer and (uint8) the finish on the GPU."""
    job = build_job(config_from_dict(config))
    train_set, _ = job.build_data()
    device = resolve_device(job.run.device)
    train_set, finish = job.loader.with_uint8(train_set, device)
    loader = make_loader(
        train_set,
        job.train.batch_size,
        seed=0,
        workers=job.loader.workers,
        pin_memory=job.loader.pins(device),
        prefetch_factor=job.loader.prefetch_factor,
    )
    batches = iter(DevicePrefetcher(loader, device, finish=finish))
    for _ in range(2):  # the loader processes' start
        next(batches)
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(ITERATIONS):
        x, _ = next(batches)
        assert x.dtype == torch.float32, "a finished batch"
    _synchronize(device)
    return time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _image_folder(root: Path, num_train: int, distinct: int = 2560) -> Path:
    """An ImageFolder of `num_train` 256 px JPEG files, so that the timed intervals lie in
    one epoch as the paper's 20 iterations did (a new epoch starts new loader processes).
    Each of `distinct` written files is linked under several names: the loader reads and
    decodes every name as its own file, and writing them all would take minutes."""
    distinct = min(num_train, distinct)
    write_image_folder(root, 1000, num_train=distinct, num_test=256, size=256)
    written = sorted((root / "train").glob("*/*.jpg"))
    for copy in range(1, -(-num_train // distinct)):
        for path in written:
            os.link(path, path.with_name(f"{path.stem}_{copy}.jpg"))
    return root


def table_one_rows(rows: list[Row], notes: list[str]) -> None:
    """Ding et al. table 1's 1-GPU column, and how more loading processes change it."""
    with tempfile.TemporaryDirectory(prefix="scaleout-gpu-") as tmp:
        root = Path(tmp)
        batch = alexnet_config(root, root, 0, True)["train"]["batch_size"]
        images = _image_folder(root / "images", ITERATIONS * batch * ALEXNET_INTERVALS)
        runs = {workers: _alexnet(root, images, workers, uint8=True) for workers in (1, 0, 8)}
        float_run = _alexnet(root, images, 1, uint8=False)
        alone = {
            (workers, uint8): _loading_alone(alexnet_config(root, images, workers, uint8))
            for workers in (0, 1)
            for uint8 in (True, False)
        }
    unit = "s / 20 iterations"
    rows.append(
        Row.median_of(
            "1 GPU, parallel loading (1 process)",
            runs[1][0],
            unit,
            "lower",
            paper=DING_TABLE_1[(1, True)],
        )
    )
    rows.append(
        Row.median_of(
            "1 GPU, serial loading", runs[0][0], unit, "lower", paper=DING_TABLE_1[(1, False)]
        )
    )
    compute = [s - w for s, w in zip(*runs[0], strict=True)]
    rows.append(
        Row.median_of("1 GPU, compute only (serial less its data wait)", compute, unit, "lower")
    )
    rows.append(Row.median_of("1 GPU, parallel loading (8 processes)", runs[8][0], unit, "lower"))
    rows.append(
        Row.median_of(
            "1 GPU, parallel loading (1 process), float32 batches", float_run[0], unit, "lower"
        )
    )
    for (workers, uint8), seconds in alone.items():
        where = f"{workers} process" if workers else "in the training process"
        batch_type = "uint8" if uint8 else "float32"
        rows.append(Row(f"loading alone, {where}, {batch_type} batches", seconds, unit, "lower"))
    serial, parallel = statistics.median(runs[0][0]), statistics.median(runs[1][0])
    rows.append(
        Row(
            "parallel loading speed-up, 1 GPU (1 process)",
            serial / parallel,
            "x",
            "higher",
            paper=round(DING_TABLE_1[(1, False)] / DING_TABLE_1[(1, True)], 3),
        )
    )
    notes.append(
        f"AlexNet on {ITERATIONS * batch * ALEXNET_INTERVALS:,} synthetic 256 px JPEG "
        f"files (1000 classes), 227 px random crops and flips, batch {batch}, uint8 batches "
        f"finished on the GPU unless a row says float32; each row the median of the "
        f"{ALEXNET_INTERVALS - 1} intervals of {ITERATIONS} iterations after a warm-up "
        "interval, all in one epoch"
    )


def training_rows(rows: list[Row]) -> None:
    """The demo's MLP on the GPU and on the CPU: the same schedule reaches the same accuracy."""
    with tempfile.TemporaryDirectory(prefix="scaleout-gpu-") as tmp:
        for device in (DEVICE, "cpu"):
            result = fit(
                MNIST_CONFIG,
                overrides=[
                    f"run.device='{device}'",
                    f"run.out_dir='{tmp}'",
                    f"run.name='mnist_{device}'",
                    f"train.steps={MNIST_STEPS}",
                    f"train.eval_every={MNIST_STEPS}",
                ],
                overwrite=True,
            )
            assert result.run_dir is not None
            last = [
                r for r in read_metrics(result.run_dir / "metrics.jsonl") if "test_accuracy" in r
            ][-1]
            rows.append(
                Row(
                    f"MNIST MLP, {MNIST_STEPS} steps on {device}: test accuracy",
                    100 * last["test_accuracy"],
                    "%",
                    "higher",
                )
            )


@register_suite(
    "gpu", "the library's CUDA paths against CPU, COTS HPC and Ding et al. table 1 on a GPU"
)
def run() -> SuiteResult:
    if not torch.cuda.is_available():
        raise UserError("bench gpu needs a CUDA GPU: torch.cuda.is_available() is False here")
    rows: list[Row] = []
    notes = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}"]
    ratios: dict[Any, float] = {}
    parts = {
        "exactness": lambda: exactness_rows(rows),
        "kernel speed": lambda: kernel_speed_rows(rows, ratios),
        "training": lambda: training_rows(rows),
        "table 1": lambda: table_one_rows(rows, notes),
    }
    for name, part in parts.items():
        # A GPU machine is lent for minutes: one part that fails is reported, and the
        # others still run.
        try:
            part()
        except Exception as error:  # noqa: BLE001 - reported in the notes, traceback shown
            traceback.print_exc()
            notes.append(f"{name} failed: {type(error).__name__}: {error}"[:500])
    return SuiteResult(rows, notes=notes)
