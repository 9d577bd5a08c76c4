"""Group bring-up: torch.distributed process groups from torchrun variables or Ray actors."""

from scaleout.comm.group import (
    GroupMember,
    ProcessGroup,
    WorkerDied,
    default_backend,
    destroy_distributed,
    free_port,
    init_distributed,
    join_group,
    run_locally,
)

__all__ = [
    "GroupMember",
    "ProcessGroup",
    "WorkerDied",
    "default_backend",
    "destroy_distributed",
    "free_port",
    "init_distributed",
    "join_group",
    "run_locally",
]
