"""Data-parallel training of the tiny model over CPU processes (torch.distributed, gloo).

The tiny model's layers are too small for a second thread to speed them up (a DiT step took the same
time on one thread and on two), but two processes with one thread each, each on half the batch,
do twice the work per second: one process per core is how `python -m recipes.tiny.train` uses a
2-core machine. Every process starts from the same seed, so the weights start identical; the
gradients are averaged in one all-reduce per step, so they stay identical and any process could
save them (process 0 does). Each process draws its own batches from its own generator.

`Shard` is what the training stages see: with `world == 1` (the default) it does nothing and needs
no process group, so the stages also run as plain single-process code.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """This process's place among `world` data-parallel training processes."""

    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def part(self, total: int, what: str) -> int:
        """This process's share of a global batch or pool of `total` items (must divide evenly)."""
        if total % self.world:
            raise ValueError(
                f"{what} {total} does not split over {self.world} training processes; "
                f"use a multiple of {self.world} or change --processes."
            )
        return total // self.world

    def generator(self, seed: int) -> torch.Generator:
        """This process's data generator: `seed` itself in a single process, else one per rank."""
        return torch.Generator().manual_seed(seed if self.world == 1 else seed * 1000 + self.rank)

    @torch.no_grad()
    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Replace every gradient by its mean over the processes (one all-reduce of a flat buffer)."""
        if self.world == 1:
            return
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def barrier(self) -> None:
        """Wait until every process gets here (e.g. until process 0 has saved what all will read)."""
        if self.world > 1:
            dist.barrier()

    @torch.no_grad()
    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over the processes (in place; returned): each fills its own rows of
        a zeroed table, and every process gets the whole one."""
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor

    @torch.no_grad()
    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Process 0's value of `tensor` on every process (in place; returned for chaining)."""
        if self.world > 1:
            dist.broadcast(tensor, src=0)
        return tensor


# The default of every training stage: one process, no process group.
SINGLE_PROCESS = Shard()


def _run_rank(rank: int, world: int, store: str, fn: Callable[[Shard], None]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(Shard(rank, world))
    finally:
        dist.destroy_process_group()


def run_data_parallel(world: int, fn: Callable[[Shard], None]) -> None:
    """Call `fn(shard)` in `world` fresh processes joined in one gloo group (in this process when
    `world == 1`). `fn` must be picklable (a module-level function or a functools.partial of one).
    An exception in any process is raised here."""
    if world < 1:
        raise ValueError(f"run_data_parallel: world must be >= 1 processes, got {world}.")
    if world == 1:
        fn(SINGLE_PROCESS)
        return
    # Loopback is always there; gloo otherwise resolves the host name, which sandboxes may not.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="tiny-train-") as tmp:
        store = str(Path(tmp) / "store")
        torch.multiprocessing.spawn(_run_rank, args=(world, store, fn), nprocs=world, join=True)
