"""Neuron selectivity for faces (COTS HPC section 5.2, after Le et al. 2012).

Every top-layer neuron's response is recorded on a labelled set — faces and non-faces
(`scaleout.data.faces`) — and each neuron is scored by the best accuracy a
single threshold on its response reaches ("face" above the threshold). The network's score
is its best neuron's. The paper: 88.2% for the trained 1.8B network, 64.8% for a random one,
64.7% for guessing the majority class on its set (ours is balanced: guessing gives 50%).

With 200 images and many neurons, the best of them separates the set better than chance
even in a random network (a maximum over many noisy scores), so the report also gives a
held-out figure: the neuron and threshold are chosen on one half of the set (stratified,
seeded) and the accuracy is measured on the other half.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

PAPER = {"trained": 0.882, "random": 0.648, "chance": 0.647}


def best_threshold_accuracy(responses: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Per neuron (column of `responses`, (M, D)), the best accuracy of "face iff response >
    t" over all thresholds t, and that threshold; (D,) each.

    Sorting each column, a threshold between sorted values k-1 and k calls the first k
    examples non-faces; only splits between distinct values are thresholds a neuron can
    realise, so ties stay together.
    """
    m = responses.shape[0]
    values, order = responses.double().sort(dim=0)  # (M, D)
    faces = labels.double()[order]  # (M, D): 1 where the k-th smallest is a face
    below_nonfaces = torch.cumsum(1.0 - faces, dim=0)  # non-faces among the k smallest
    below_faces = torch.cumsum(faces, dim=0)
    total_faces = faces[:, :1].sum()
    correct = torch.cat(
        [total_faces.expand(1, responses.shape[1]), below_nonfaces + (total_faces - below_faces)]
    )  # (M + 1, D): split after 0, 1, ..., M examples
    realisable = torch.ones_like(correct, dtype=torch.bool)
    realisable[1:-1] = values[1:] > values[:-1]
    correct = correct.masked_fill(~realisable, -1.0)
    best, split = correct.max(dim=0)
    lower = torch.where(
        split > 0, values[(split - 1).clamp_min(0), torch.arange(values.shape[1])], -torch.inf
    )
    upper = torch.where(
        split < m, values[split.clamp_max(m - 1), torch.arange(values.shape[1])], torch.inf
    )
    threshold = torch.where(
        torch.isfinite(lower) & torch.isfinite(upper),
        (lower + upper) / 2,
        torch.where(torch.isfinite(lower), lower, upper - 1.0),
    )
    return best / m, threshold


@torch.no_grad()
def record_responses(network: nn.Module, images: Tensor, batch_size: int = 20) -> Tensor:
    """Top-layer responses, (M, D): the network's output flattened per image."""
    device = next(network.parameters()).device
    network.eval()
    rows = [
        network(images[i : i + batch_size].to(device)).reshape(len(images[i : i + batch_size]), -1)
        for i in range(0, len(images), batch_size)
    ]
    return torch.cat(rows).float().cpu()


def selectivity(
    network: nn.Module, images: Tensor, labels: Tensor, seed: int = 0
) -> dict[str, Any]:
    """The best single neuron's face/non-face accuracy, on the whole set and held out."""
    responses = record_responses(network, images)
    accuracy, _ = best_threshold_accuracy(responses, labels)
    best = int(accuracy.argmax())
    # Held out: choose neuron and threshold on a stratified half, score on the other half.
    generator = torch.Generator().manual_seed(seed)
    select = torch.zeros(len(labels), dtype=torch.bool)
    for label in (0, 1):
        members = torch.nonzero(labels == label).squeeze(1)
        chosen = members[torch.randperm(len(members), generator=generator)[: len(members) // 2]]
        select[chosen] = True
    half_accuracy, half_threshold = best_threshold_accuracy(responses[select], labels[select])
    neuron = int(half_accuracy.argmax())
    predicted = responses[~select, neuron] > half_threshold[neuron]
    heldout = (predicted.long() == labels[~select]).double().mean().item()
    return {
        "best_accuracy": accuracy[best].item(),
        "best_neuron": best,
        "heldout_accuracy": heldout,
        "num_neurons": responses.shape[1],
    }
