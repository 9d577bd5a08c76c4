"""Tests for scaleout.data: IDX reading, data sets, natural-image patches, loaders."""

from __future__ import annotations

import torch

from scaleout.data import (
    SyntheticDataset,
    make_loader,
)


def test_make_loader_workers_match_single_process():
    d = SyntheticDataset(40, (1, 4, 4), num_classes=3, seed=2)
    single = list(make_loader(d, 7, seed=9, workers=0))
    multi = list(make_loader(d, 7, seed=9, workers=2))
    assert len(single) == len(multi) == 6
    for (ax, ay), (bx, by) in zip(single, multi, strict=True):
        assert torch.equal(ax, bx) and torch.equal(ay, by)
