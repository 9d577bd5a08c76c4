"""An optimizer that reads whole tensors, for the tests: LAMB's layer-wise trust ratio
scales each tensor's step by its own norm, so a flat slice steps otherwise."""

import torch


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                ratio = p.norm() / p.grad.norm().clamp(min=1e-12)
                p.add_(p.grad, alpha=-group["lr"] * float(ratio))


def lamb(params):
    return Lamb(params)
