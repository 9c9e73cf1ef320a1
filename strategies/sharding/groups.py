"""Which ranks share one copy of the model state, and which hold copies of the same shard.

Without hybrid sharding every data-parallel rank shares one copy (one shard group, no replication). With
`shard_group_size=G` (FSDP's HYBRID_SHARD, FSDP2's 2-D mesh, ZeRO++'s hpZ) the ranks form groups of G consecutive
ranks that shard among themselves, and the ranks at the same place in each group hold the same shard: gradients
are reduce-scattered within a group and then all-reduced across the groups, so the slower links between machines
carry only a 1/G slice of the gradients and never the parameters.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


def _weak(group: Any) -> Any:
    return None if group is None else weakref.ref(group)


def _strong(reference: Any) -> Any:
    return None if reference is None else reference()


@dataclass(frozen=True)
class Groups:
    """The groups are held weakly (torch.distributed holds them until destroy_process_group): a group that
    outlives its destruction keeps gloo's worker threads running into interpreter shutdown, where one that
    releases a finished collective's tensors aborts the process."""

    _everyone: Any  # the data-parallel group (None: the default group); gradients are averaged over it
    _shard: Any  # ranks that share one copy of the state
    _replicate: Any  # ranks that hold the same shard (None: one copy)
    rank: int  # in the shard group
    size: int  # of the shard group
    data_parallel_size: int
    replica: int  # which copy this rank belongs to
    hybrid: bool = field(init=False)  # several copies: gradients are also all-reduced across the groups

    def __post_init__(self) -> None:
        object.__setattr__(self, "hybrid", self._replicate is not None)  # (read at every step: derived once)

    @classmethod
    def of(cls, everyone: Any, shard: Any, replicate: Any, *sizes: int) -> Groups:
        return cls(_weak(everyone), _weak(shard), _weak(replicate), *sizes)

    @property
    def everyone(self) -> Any:
        return _strong(self._everyone)

    @property
    def shard(self) -> Any:
        return _strong(self._shard)

    @property
    def replicate(self) -> Any:
        return _strong(self._replicate)

    @property
    def source(self) -> int:
        """The global rank whose values every rank starts from."""
        return dist.get_global_rank(self.everyone, 0) if self.everyone is not None else 0


def make_groups(
    everyone: Any = None, shard_group_size: int | None = None, every_data_parallel_group: list[list[int]] | None = None
) -> Groups:
    """Collective when `shard_group_size` splits the ranks: every rank must call it, in the same order.
    `every_data_parallel_group`: the global ranks of every data-parallel group when there are several (tensor
    parallel: one per tensor-parallel position), so that every rank makes every group's subgroups alike."""
    if not dist.is_initialized():
        return Groups.of(everyone, everyone, None, 0, 1, 1, 0)
    world = dist.get_world_size(everyone)
    if shard_group_size is None or shard_group_size == world:
        return Groups.of(everyone, everyone, None, dist.get_rank(everyone), world, world, 0)
    if not 1 <= shard_group_size <= world or world % shard_group_size:
        raise ValueError(
            f"hybrid_shard={shard_group_size} must divide the {world} data-parallel ranks into equal groups; "
            f"choose one of {[g for g in range(1, world + 1) if world % g == 0]}"
        )
    ranks = dist.get_process_group_ranks(everyone) if everyone is not None else list(range(world))
    size = shard_group_size
    groups = every_data_parallel_group or [ranks]
    shard, _ = dist.new_subgroups_by_enumeration([g[i : i + size] for g in groups for i in range(0, world, size)])
    replicate, _ = dist.new_subgroups_by_enumeration([g[offset::size] for g in groups for offset in range(size)])
    return Groups.of(everyone, shard, replicate, dist.get_rank(shard), size, world, dist.get_rank(replicate))
