"""Checkpoints: safetensors + a JSON sidecar, written atomically, verified on load.

A checkpoint `step_00001000` is two files: `step_00001000.safetensors` (the tensors) and
`step_00001000.json` (step, config, metrics, optimizer hyper-parameters, and the SHA-256 of
both the tensor file and its own metadata). Each is written to a temporary file, flushed and
renamed into place, tensors first: the sidecar is the commit point, so a process killed at
any moment leaves either the previous checkpoint or the new one, never half of one. Loading
recomputes both checksums and refuses a file with a single flipped byte. No pickle anywhere:
a checkpoint from an untrusted source cannot run code.

Tensors that share storage (tied weights: a language model's output layer that *is* its
embedding) are saved once, as safetensors asks: the others are recorded in the sidecar as
aliases of the name kept, and loading gives every alias the very tensor it names, so the
sharing comes back. A tensor that overlaps another one otherwise is saved as a copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from scaleout.errors import CheckpointError, DiskError

FORMAT = "scaleout.checkpoint/1"
_STEM = re.compile(r"^step_(\d{8,})\.json$")


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write `path` through `write(tmp)`, then fsync and rename: readers never see a partial
    file. The temporary file is removed if writing fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # keep the write's own error, not the clean-up's
            tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _meta_sha256(meta: dict[str, Any], aliases: dict[str, str] | None = None) -> str:
    checked: Any = meta if not aliases else {"aliases": aliases, "meta": meta}
    return hashlib.sha256(json.dumps(checked, sort_keys=True).encode()).hexdigest()


def unshared(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each storage once: (tensors to write, {alias: name kept}). A tensor that is the same
    view of the same storage as an earlier one is an alias of it; one that overlaps an
    earlier one's storage otherwise is copied."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple[Any, ...], str] = {}
    storages: set[tuple[str, int]] = set()
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        storage = tensor.untyped_storage()
        if tensor.numel() == 0 or storage.data_ptr() == 0:
            kept[name] = tensor
            continue
        where = (str(tensor.device), storage.data_ptr())
        view = (*where, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if view in views:
            aliases[name] = views[view]
            continue
        views[view] = name
        kept[name] = tensor.clone() if where in storages else tensor
        storages.add(where)
    return kept, aliases


def on_cpu_shared_once(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` detached and on the CPU, each alias (`unshared`) the very tensor object of
    the name it shares: the sharing survives pickling (a worker's state sent through Ray)
    and the checkpoint saves it once."""
    kept, aliases = unshared(tensors)
    moved = {name: tensor.cpu() for name, tensor in kept.items()}
    for alias, name in aliases.items():
        moved[alias] = moved[name]
    return {name: moved[name] for name in tensors}


def save_checkpoint(stem: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write `<stem>.safetensors` and then `<stem>.json`; return the sidecar's path."""
    kept, aliases = unshared(tensors)
    cpu = {name: t.to("cpu").contiguous() for name, t in kept.items()}
    tensor_path = stem.with_suffix(".safetensors")
    atomic_write(tensor_path, lambda tmp: _save_tensors(cpu, tmp))
    meta = json.loads(json.dumps(meta))  # JSON types only, so the checksum is reproducible
    sidecar: dict[str, Any] = {
        "format": FORMAT,
        "tensors": tensor_path.name,
        "sha256": file_sha256(tensor_path),
        "meta": meta,
        "meta_sha256": _meta_sha256(meta, aliases),
    }
    if aliases:
        sidecar["aliases"] = aliases
    json_path = stem.with_suffix(".json")
    atomic_write(json_path, lambda tmp: tmp.write_text(json.dumps(sidecar, indent=1)))
    return json_path


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`save_file`, with its I/O failures as the `OSError` they are: safetensors reports a
    full disk as `SafetensorError('... No space left on device (os error 28)')`."""
    try:
        save_file(tensors, str(path))
    except SafetensorError as err:
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from err


def load_checkpoint(json_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read and verify a checkpoint; raise `CheckpointError` naming the file otherwise."""
    try:
        sidecar = json.loads(json_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {json_path} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"checkpoint {json_path} is corrupted (unreadable JSON: {err})"
        ) from None
    if not isinstance(sidecar, dict) or sidecar.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {json_path} is not a {FORMAT} sidecar")
    meta = sidecar.get("meta")
    aliases = sidecar.get("aliases", {})
    if (
        not isinstance(meta, dict)
        or not isinstance(aliases, dict)
        or sidecar.get("meta_sha256") != _meta_sha256(meta, aliases)
    ):
        raise CheckpointError(
            f"checkpoint {json_path} is corrupted: its metadata fails the SHA-256 check"
        )
    tensor_path = json_path.with_name(str(sidecar.get("tensors")))
    if tensor_path.parent != json_path.parent or not tensor_path.is_file():
        raise CheckpointError(
            f"checkpoint {json_path}: its tensor file {tensor_path.name} is missing"
        )
    if file_sha256(tensor_path) != sidecar.get("sha256"):
        raise CheckpointError(
            f"checkpoint {tensor_path} is corrupted: SHA-256 differs from the one recorded in "
            f"{json_path.name}; delete both files to fall back to an earlier checkpoint"
        )
    tensors = load_file(str(tensor_path))
    for alias, name in aliases.items():
        if name not in tensors:
            raise CheckpointError(
                f"checkpoint {json_path}: {alias!r} shares {name!r}, which the tensor file lacks"
            )
        tensors[alias] = tensors[name]  # shared again, as when it was saved
    return tensors, meta


OptimizerState = tuple[dict[str, torch.Tensor], dict[str, Any]]  # tensors, JSON metadata


def optimizer_state(optimizer: torch.optim.Optimizer) -> OptimizerState:
    """Split an optimizer's state into tensors (`optim.<param>.<key>`) and JSON metadata."""
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param_id, state in state_dict["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{param_id}.{key}"] = value
            else:
                scalars.setdefault(str(param_id), {})[key] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def optimizer_part(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> OptimizerState | None:
    """The optimizer's part of a checkpoint (as `optimizer_state` gave it), None if it holds
    no optimizer state."""
    if "optimizer" not in meta:
        return None
    return {k: v for k, v in tensors.items() if k.startswith("optim.")}, meta["optimizer"]


def required_optimizer_part(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any], source: str
) -> OptimizerState:
    """`optimizer_part`, or a `CheckpointError` naming `source` when it holds none."""
    part = optimizer_part(tensors, meta)
    if part is None:
        raise CheckpointError(
            f"checkpoint {source} holds no optimizer state (it was written by a strategy "
            "whose optimizer lives on parameter-server shards); resume it with that strategy"
        )
    return part


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    """Inverse of `optimizer_state`."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, param_id, key = name.split(".", 2)
            state.setdefault(int(param_id), {})[key] = value
    for param_id, values in meta["scalars"].items():
        state.setdefault(int(param_id), {}).update(values)
    try:
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    except (ValueError, KeyError) as err:
        raise CheckpointError(
            f"checkpoint optimizer state does not fit this optimizer: {err}"
        ) from None


class CheckpointDir:
    """The checkpoints of one run: `step_<N>.{safetensors,json}`, the newest `keep` kept."""

    def __init__(self, directory: Path, keep: int = 2) -> None:
        self.directory = directory
        self.keep = keep

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        found = (_STEM.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}.json"

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
        """Write checkpoint `step`, then drop all but the newest `keep`. A write that fails
        (full disk, no permission) raises a one-line `DiskError` naming the file; it leaves
        the earlier checkpoints as they were and no tensor file without its sidecar."""
        stem = self.path(step).with_suffix("")
        try:
            for stale in self.directory.glob(".*.tmp"):  # left by a process killed mid-write
                stale.unlink(missing_ok=True)
            path = save_checkpoint(stem, tensors, meta)
        except OSError as err:
            if not self.path(step).exists():  # no sidecar, no checkpoint: drop the orphan
                with contextlib.suppress(OSError):
                    stem.with_suffix(".safetensors").unlink(missing_ok=True)
            earlier = [s for s in self.steps() if s < step]
            note = (
                f"the previous checkpoint {self.path(earlier[-1])} is intact"
                if earlier
                else "no earlier checkpoint was written"
            )
            raise DiskError.writing("checkpoint", stem, err, note) from None
        for old in self.steps()[: -self.keep]:
            self.path(old).unlink(missing_ok=True)  # sidecar first: it is the commit point
            self.path(old).with_suffix(".safetensors").unlink(missing_ok=True)
        return path
