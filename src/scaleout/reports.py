"""`scaleout eval selectivity RUN_DIR`: how well the best single neuron of a trained sparse
autoencoder tells faces from non-faces (Le et al. 2012), beside a random network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from scaleout.api import config_from_dict
from scaleout.checkpoint import load_checkpoint
from scaleout.data.faces import face_dataset
from scaleout.errors import UserError
from scaleout.nn.config import SparseAutoencoderModel
from scaleout.nn.selectivity import PAPER, selectivity
from scaleout.rundir import CONFIG_FILE, RunDir


def selectivity_report(run_dir: Path, seed: int = 0) -> dict[str, Any]:
    """Selectivity of the trained network in `run_dir` (its latest checkpoint) and of a
    randomly initialised network of the same configuration; the numbers the CLI verb
    `scaleout eval selectivity RUN_DIR` prints."""
    run_dir = Path(run_dir)
    config_path = run_dir / CONFIG_FILE
    if not config_path.is_file():
        raise UserError(f"{run_dir}: no {CONFIG_FILE} here; give the directory of a training run")
    config = config_from_dict(json.loads(config_path.read_text()), source=str(config_path))
    if not isinstance(config.model, SparseAutoencoderModel):
        raise UserError(
            f"{run_dir}: selectivity needs a sparse_autoencoder run, this one trained "
            f"model.kind = {config.model.kind!r}"
        )
    checkpoint = RunDir(run_dir).checkpoints.latest()
    if checkpoint is None:
        raise UserError(f"{run_dir}: no checkpoint to evaluate; train the run first")
    tensors, meta = load_checkpoint(checkpoint)
    torch.manual_seed(config.run.seed)
    trained = config.model.build()
    weights = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    trained.load_state_dict(weights)
    del tensors, weights
    images, labels = face_dataset(config.model.in_size, config.model.in_channels)
    report: dict[str, Any] = {
        "run": str(run_dir),
        "checkpoint": checkpoint.name,
        "step": meta.get("step"),
        "num_faces": int(labels.sum()),
        "num_nonfaces": int((labels == 0).sum()),
        "chance": max(float(labels.float().mean()), 1 - float(labels.float().mean())),
        "trained": selectivity(trained, images, labels, seed),
    }
    del trained
    torch.manual_seed(config.run.seed + 1)  # a different draw from the trained run's start
    random = config.model.build()
    report["random"] = selectivity(random, images, labels, seed)
    report["paper"] = PAPER
    return report
