"""Process-group set-up for 1 process (`specdraft train`) or N ranks (`deepspeed --num_gpus N ...`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.build_locks import clear_stale_build_locks
from core.net import free_port


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """Start (or join) the process group. Without a launcher we become a 1-rank world on localhost.

    The backend comes from DeepSpeed's accelerator: NCCL on CUDA, gloo on the CPU accelerator.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": os.environ.get("MASTER_PORT", str(free_port()))})
    if not dist.is_initialized():
        clear_stale_build_locks()  # a run killed while DeepSpeed built its CPU op would hang every later one
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistInfo(rank, world, local_rank, device)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is True on any rank (so all ranks stop/save together)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    return bool(all_reduce_sum(t).item() > 0)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def finish_distributed() -> None:
    """Leave the process group before exiting. A rank that exits with gloo still set up can abort in the
    group's destructor ("terminate called without an active exception", exit code -6) although its work
    is done (seen on 2-rank CPU runs of bench/partitioned_base.py)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
