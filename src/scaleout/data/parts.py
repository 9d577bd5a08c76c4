"""Disjoint parts of a data set: what each Downpour replica trains on."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from scaleout.data.datasets import ArrayDataset


def data_part(dataset: Any, part: int, num_parts: int) -> Any:  # noqa: ANN401
    """Every `num_parts`-th example from `part` on: disjoint parts that cover the data.
    One part is the data set itself."""
    if num_parts == 1:
        return dataset
    indices = torch.arange(part, len(dataset), num_parts)
    if isinstance(dataset, ArrayDataset):
        y = None if dataset.y is None else dataset.y[indices]
        return ArrayDataset(dataset.x[indices], y, dataset.num_classes)
    return Part(dataset, indices)


class Part(Dataset):
    """A view of some examples of a dataset that keeps its batched fetch and collate."""

    def __init__(self, dataset: Any, indices: torch.Tensor) -> None:  # noqa: ANN401
        self.dataset, self.indices = dataset, indices.tolist()
        self.num_classes = getattr(dataset, "num_classes", 0)
        if hasattr(dataset, "__getitems__") and hasattr(dataset, "collate"):
            self.collate = dataset.collate

    def __len__(self) -> int:
        return len(self.indices)

    def set_epoch(self, epoch: int) -> None:
        """Tell the data set the epoch (its random crops and flips depend on it)."""
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __getitem__(self, i: int) -> Any:  # noqa: ANN401
        return self.dataset[self.indices[i]]

    def __getitems__(self, indices: list[int]) -> Any:  # noqa: ANN401
        picked = [self.indices[i] for i in indices]
        if hasattr(self.dataset, "__getitems__"):
            return self.dataset.__getitems__(picked)
        return [self.dataset[i] for i in picked]
