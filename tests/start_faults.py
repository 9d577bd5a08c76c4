"""For the start-time fault tests: a model factory, an MLP whose construction inside a Ray
actor dies or raises as the test asks (through a file, since actors run in their own
processes; in the driver it is a plain MLP), and a backup keeper that kills a backup as it
starts."""

import os
import signal
from pathlib import Path

import ray
from torch import nn

from scaleout.ps.backup import BackupKeeper


def in_an_actor() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


class Unmovable(nn.Sequential):
    """Built anywhere, but moved to a device inside an actor it raises, every time."""

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202
        if in_an_actor():
            raise RuntimeError("cannot move this model here")
        return super()._apply(fn, recurse)


def mlp(sizes: list[int], dies_once: str = "", always_raises: bool = False) -> nn.Module:
    """`dies_once`: a path; the first actor to build the model creates it and is SIGKILLed
    (a process lost while it starts). `always_raises`: in every actor, moving the model to
    its device raises the same error (a deterministic failure, not a user's config error:
    a factory that raises is one, and stops the run at once)."""
    if in_an_actor() and dies_once and not Path(dies_once).exists():
        Path(dies_once).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    return (Unmovable if always_raises else nn.Sequential)(*layers)


class KeeperKillingItsFirstBackup(BackupKeeper):
    """Starts backups as the library's keeper does, but kills the first one it starts at
    once (a backup lost while it starts, before it took its primary's state), and then
    creates the file `marker` names (set it on a subclass)."""

    marker = ""

    def spawn(self, actor_class, args, node, resource):  # noqa: ANN001, ANN201
        handle = super().spawn(actor_class, args, node, resource)
        if not Path(self.marker).exists():
            ray.kill(handle, no_restart=True)
            Path(self.marker).touch()
        return handle
