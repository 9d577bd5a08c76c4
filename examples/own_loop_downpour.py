"""Your own training loop in your own Ray actors, on scaleout's parameter server.

For users who keep their loop (torchft's style: wrappers that leave the loop unchanged):
`ParameterServer.create` starts the shards, each holding a slice of the flat parameter
vector and applying the optimizer to it; `ReplicaClient` wraps the loop with Downpour SGD's
schedule — fetch fresh parameters every `n_fetch` steps, push the accumulated gradient every
`n_push` steps without waiting for it to be applied.

    python examples/own_loop_downpour.py --replicas 2 --steps 300

Two replicas below, each a Ray actor training on its half of MNIST (shipped with the
project); the script evaluates the shards' parameters at the end.
"""

from __future__ import annotations

import argparse

import ray
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from scaleout.data import load_image_idx
from scaleout.ps import OptimizerSpec, ParameterServer, ReplicaClient


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))


@ray.remote(num_cpus=0.5)
class Replica:
    """A plain PyTorch loop; the three client calls are all that Downpour adds to it."""

    def __init__(self, server: ParameterServer, part: int, num_parts: int) -> None:
        torch.set_num_threads(1)
        data = load_image_idx("mnist", "train")
        self.x, self.y = data.x[part::num_parts], data.y[part::num_parts]  # (N, 1, 28, 28), (N,)
        self.model = build_model()
        self.client = ReplicaClient([(self.model.parameters(), server)], n_fetch=3, n_push=3)
        self.generator = torch.Generator().manual_seed(part)

    def train(self, steps: int, batch_size: int = 64) -> float:
        losses = []
        for _ in range(steps):
            index = torch.randint(len(self.x), (batch_size,), generator=self.generator)
            self.client.before_step()  # every n_fetch steps: the shards' parameters
            loss = F.cross_entropy(self.model(self.x[index]), self.y[index])
            loss.backward()  # no zero_grad: the client sums gradients between pushes
            self.client.after_backward()  # every n_push steps: push, without waiting
            losses.append(loss.item())
        self.client.flush()  # push what is left, wait for the shards, fetch the end
        return sum(losses[-50:]) / len(losses[-50:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        model = build_model()
        initial = parameters_to_vector(model.parameters())  # (P,) in the model's order
        server = ParameterServer.create(initial, args.shards, OptimizerSpec("adagrad", lr=0.05))
        replicas = [Replica.remote(server, r, args.replicas) for r in range(args.replicas)]
        losses = ray.get([replica.train.remote(args.steps) for replica in replicas])
        vector_to_parameters(server.values(), model.parameters())
        test = load_image_idx("mnist", "test")
        with torch.no_grad():
            accuracy = (model(test.x).argmax(dim=1) == test.y).float().mean().item()
        print(f"final training losses {[round(v, 4) for v in losses]}")
        print(f"{args.replicas} replicas x {args.steps} steps: test accuracy {100 * accuracy:.2f}%")
        server.kill()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
