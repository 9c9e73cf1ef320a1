"""Every parallel dimension of a run in one object: the sizes, checked against the world size in one place, each
rank's place on them, the device mesh the module sees and the process groups the engine and the Trainer use (the
shape of torchtitan's ParallelDims).

The ranks are laid out pipeline outermost (its point-to-point sends cross the slowest link best), then data
parallel, then context parallel, then tensor parallel innermost (the ranks that split a layer are neighbours, on
one node, where the link is fastest), as torchtitan orders its mesh:

    rank = ((pipeline_rank * data + data_parallel_rank) * context + context_rank) * tensor + tensor_rank

- data parallel: the ranks that read different samples (samplers split the data over them). Under hybrid
  sharding they are copies (replicate) of groups that shard among themselves (shard).
- context parallel: the ranks of one group read the same samples and split each sequence (context_parallel.py).
- tensor parallel: the ranks of one group split each layer (tensor_parallel.py).
- pipeline parallel: the ranks of one group hold different stages of the model and read the same samples; the
  activations of micro-batches flow from one to the next (pipeline_parallel.py).

The engine averages gradients, and shards the model state, over the ranks at one pipeline and tensor-parallel
position: the data-parallel and the context-parallel ranks together (they hold the same parameters and see
different tokens), as torchtitan folds context parallel into FSDP's shard dimension. Hybrid sharding splits those
ranks into groups of `shard_group` consecutive ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

PIPELINE_PARALLEL, DATA_PARALLEL = "pipeline_parallel", "data_parallel"
CONTEXT_PARALLEL, TENSOR_PARALLEL = "context_parallel", "tensor_parallel"


def check_size(owner: str, argument: str, value: Any, auto: bool = False) -> int | str:
    """A parallel size as given, checked: a positive int (or "auto" where it may be)."""
    if (auto and value == "auto") or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    choices = 'a positive int or "auto" (the GPUs of one node)' if auto else "a positive int"
    raise ValueError(f"{owner}: {argument}={value!r}; choose {choices}")


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of every parallel dimension of `world_size` ranks."""

    world_size: int
    tensor: int = 1
    context: int = 1
    pipeline: int = 1

    @classmethod
    def resolve(
        cls, world_size: int, tensor: int | str, context: int, ranks_per_node: int, pipeline: int = 1
    ) -> ParallelDims:
        """The dimensions for `world_size` ranks ("auto" tensor parallel: the ranks of one node), checked: each
        size must divide the ranks, and together they must too."""
        tensor = ranks_per_node if tensor == "auto" else tensor
        for argument, size, given in (
            ("tensor_parallel_size", tensor, tensor),
            ("context_parallel_size", context, context),
            ("pipeline_parallel_size", pipeline, pipeline),
        ):
            if world_size % size:
                raise ValueError(
                    f"{argument}={given!r} ({size}) does not divide the {world_size} ranks (devices x num_nodes); "
                    f"choose one of {_divisors(world_size)}"
                )
        if world_size % (tensor * context * pipeline):
            given = [(n, v) for n, v in (("tensor", tensor), ("context", context), ("pipeline", pipeline)) if v > 1]
            product = " x ".join(f"{name}_parallel_size={value}" for name, value in given)
            raise ValueError(
                f"{product} = {tensor * context * pipeline} does not divide the {world_size} ranks; choose sizes "
                f"whose product is one of {_divisors(world_size)}"
            )
        return cls(world_size, tensor, context, pipeline)

    @property
    def data_parallel(self) -> int:
        """The ranks that read different samples."""
        return self.world_size // (self.tensor * self.context * self.pipeline)

    @property
    def ranks_per_stage(self) -> int:
        """The ranks that hold one pipeline stage (every rank without a pipeline)."""
        return self.world_size // self.pipeline

    @property
    def gradient_ranks(self) -> int:
        """The ranks that average gradients and shard the model state: data-parallel x context-parallel."""
        return self.data_parallel * self.context

    def data_parallel_rank(self, rank: int) -> int:
        return rank // (self.context * self.tensor) % self.data_parallel

    def pipeline_rank(self, rank: int) -> int:
        return rank // self.ranks_per_stage

    def context_rank(self, rank: int) -> int:
        return rank // self.tensor % self.context

    def tensor_rank(self, rank: int) -> int:
        return rank % self.tensor

    def gradient_groups(self) -> list[list[int]]:
        """For each pipeline and tensor-parallel position, its ranks in (data-parallel, context-parallel) order."""
        stage = self.ranks_per_stage
        positions = [(p, t) for p in range(self.pipeline) for t in range(self.tensor)]
        return [list(range(p * stage + t, (p + 1) * stage, self.tensor)) for p, t in positions]

    def make_mesh(self, device_type: str) -> DeviceMesh:
        """The device mesh the module sees (`self.device_mesh`): dimensions "pipeline_parallel", "data_parallel",
        "context_parallel" and "tensor_parallel" (Lightning's ModelParallelStrategy names the data and tensor
        ones so). Collective."""
        shape = (self.pipeline, self.data_parallel, self.context, self.tensor)
        names = (PIPELINE_PARALLEL, DATA_PARALLEL, CONTEXT_PARALLEL, TENSOR_PARALLEL)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)


class ParallelGroups:
    """The process groups of a run's dimensions, made once on every rank together (collective): the mesh's, and
    this rank's gradient group (its data-parallel and context-parallel ranks; None when that is every rank)."""

    def __init__(self, dims: ParallelDims, device_type: str) -> None:
        self.dims = dims
        self.mesh = dims.make_mesh(device_type)
        self.gradient: Any = None
        if dims.tensor > 1 or dims.pipeline > 1:
            self.gradient, _ = dist.new_subgroups_by_enumeration(dims.gradient_groups())

    def group(self, name: str) -> Any:
        """The process group of this rank along one of the mesh's dimensions."""
        return self.mesh[name].get_group()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
