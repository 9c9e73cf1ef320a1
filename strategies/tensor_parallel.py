"""Tensor parallel under every strategy, on torch's DTensor.

The module applies torch's own tensor parallel in `configure_model` (`parallelize_module` with `ColwiseParallel`,
`RowwiseParallel`, ... on `device_mesh["tensor_parallel"]`): its parameters become DTensors, each rank holding a
local piece. Before the engine sets the module up, every DTensor parameter is replaced by a plain parameter holding
that local piece, and the module that owns it turns it back into a DTensor (`DTensor.from_local`, which is
differentiable) each time it computes. The engine then shards, gathers and reduces the local pieces over the
data-parallel ranks only, as it does any parameter, while torch's DTensor does the tensor-parallel collectives
inside the forward and backward passes. Names stay the model's; shapes are the local pieces'
(`TensorParallelLayout` keeps each one's place in the full tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .sharding import FlatPieces


@dataclass(frozen=True)
class TensorParallelLayout:
    """Where a parameter's local piece lies in the full tensor."""

    placements: tuple[Any, ...]
    shape: torch.Size  # of the full tensor
    stride: tuple[int, ...]
    offsets: tuple[int, ...]  # of the local piece in the full tensor, per dimension
    local_shape: torch.Size

    @property
    def replicated(self) -> bool:
        """Whether every tensor-parallel rank holds the whole tensor."""
        return not any(isinstance(p, Shard) for p in self.placements)


class TensorParallelParameters:
    """The DTensor parameters of a module, held as plain local parameters (see the module docstring).

    Args:
        module: the model after `configure_model` applied tensor parallel.
        mesh: the strategy's tensor-parallel mesh: every DTensor parameter must be on it.
        hook: where the DTensors were made, for the error that finds none.

    Raises:
        ValueError: if no parameter is a DTensor, or one is on another mesh.
    """

    def __init__(self, module: nn.Module, mesh: DeviceMesh, hook: str = "configure_model") -> None:
        self.mesh = mesh
        self.layouts: dict[str, TensorParallelLayout] = {}  # by parameter name
        self._by_module: dict[nn.Module, dict[str, TensorParallelLayout]] = {}
        for module_name, owner in module.named_modules():
            for name, param in list(owner._parameters.items()):
                if isinstance(param, DTensor):
                    full_name = f"{module_name}.{name}" if module_name else name
                    layout = self._local(owner, name, param, full_name)
                    self.layouts[full_name] = layout
                    self._by_module.setdefault(owner, {})[name] = layout
        if not self.layouts:
            raise ValueError(
                f"tensor_parallel_size={mesh.size()}: no parameter is a DTensor after {hook}. Apply torch's tensor "
                "parallel there, e.g. parallelize_module(self.model, self.device_mesh['tensor_parallel'], "
                "{'attention.wq': ColwiseParallel(), ...}), or use tensor_parallel_size=1"
            )
        self._hooks: list[Any] = []

    def install(self) -> None:
        """Hook each owning module so that it computes with DTensors. Called once the engine has set the module
        up: these hooks then run after the engine's, which gather a unit's parameters first."""
        self._hooks = [h for owner in self._by_module for h in self._install(owner)]

    def _local(self, owner: nn.Module, name: str, param: DTensor, full_name: str) -> TensorParallelLayout:
        if param.device_mesh != self.mesh:
            raise ValueError(
                f"parameter {full_name!r} is a DTensor on the mesh {param.device_mesh}, not on the strategy's "
                f"tensor-parallel mesh {self.mesh}: apply tensor parallel on self.device_mesh['tensor_parallel']"
            )
        local = param.to_local()
        layout = TensorParallelLayout(
            tuple(param.placements),
            param.shape,
            tuple(param.stride()),
            _offsets(param.shape, local.shape, param.placements, self.mesh),
            local.shape,
        )
        owner._parameters[name] = nn.Parameter(local.detach(), requires_grad=param.requires_grad)
        return layout

    def _install(self, owner: nn.Module) -> list[Any]:
        layouts = self._by_module[owner]

        def as_dtensors(module: nn.Module, args: Any) -> None:
            for name, layout in layouts.items():  # shadows the plain parameter while the module computes
                module.__dict__[name] = self.dtensor(module._parameters[name], layout)

        def as_plain(module: nn.Module, args: Any, output: Any) -> Any:
            for name in layouts:
                module.__dict__.pop(name, None)
            return output

        def state_dict_as_dtensors(module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
            for name, layout in layouts.items():  # as FSDP2 gives them (keep_vars=True: the engine's own reads)
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and not isinstance(value, (DTensor, nn.Parameter)):
                    state_dict[prefix + name] = self.dtensor(value, layout)

        def load_local_pieces(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
            for name, layout in layouts.items():
                if prefix + name in state_dict:
                    state_dict[prefix + name] = self.local_piece(prefix + name, state_dict[prefix + name], layout)

        return [
            owner.register_forward_pre_hook(as_dtensors),
            owner.register_forward_hook(as_plain),
            owner.register_state_dict_post_hook(state_dict_as_dtensors),
            owner.register_load_state_dict_pre_hook(load_local_pieces),
        ]

    def local_piece(self, key: str, value: torch.Tensor, layout: TensorParallelLayout) -> torch.Tensor:
        """This rank's piece of a value `module.load_state_dict` is given: a DTensor (as `state_dict()` gives
        them) or a whole tensor (a plain state dict, pretrained weights). A tensor of the piece's shape is refused:
        it may be another rank's piece."""
        if isinstance(value, DTensor):
            return value.redistribute(self.mesh, layout.placements).to_local()
        if tuple(value.shape) == tuple(layout.shape):
            return value[tuple(slice(o, o + n) for o, n in zip(layout.offsets, layout.local_shape))]
        raise ValueError(
            f"load_state_dict: {key!r} is split by tensor parallel (whole shape {list(layout.shape)}, this rank's "
            f"piece {list(layout.local_shape)}); give the whole tensor or the DTensor state_dict() returns, not a "
            f"tensor of shape {list(value.shape)} (one rank's piece of it, maybe another rank's)"
        )

    def dtensor(self, local: torch.Tensor, layout: TensorParallelLayout) -> DTensor:
        """The local piece as a DTensor of the full shape (differentiable)."""
        return DTensor.from_local(
            local, self.mesh, layout.placements, run_check=False, shape=layout.shape, stride=layout.stride
        )

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of parameter `name` from this rank's (data-parallel gathered) local piece. Collective
        over the tensor-parallel ranks."""
        return self.dtensor(local, self.layouts[name]).full_tensor()

    def sharded_names(self) -> set[str]:
        """The parameters whose local pieces differ between the tensor-parallel ranks."""
        return {name for name, layout in self.layouts.items() if not layout.replicated}

    def split(self, name: str) -> SplitParameter:
        """How the engine puts parameter `name`'s pieces together (for an optimizer that steps whole tensors)."""
        return SplitParameter(self, self.layouts[name])


class SplitParameter:
    """One split parameter as the engine's whole-tensor steps see it (sharding/whole_tensors.py's SplitTensor):
    the whole tensor from the tensor-parallel ranks' pieces, and this rank's piece of a whole one."""

    def __init__(self, parameters: TensorParallelParameters, layout: TensorParallelLayout) -> None:
        self.parameters, self.layout, self.shape = parameters, layout, layout.shape

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return self.parameters.dtensor(local.contiguous(), self.layout).full_tensor()

    def piece(self, whole: torch.Tensor) -> torch.Tensor:
        return whole[tuple(slice(o, o + n) for o, n in zip(self.layout.offsets, self.layout.local_shape))]


def _offsets(shape: torch.Size, local_shape: torch.Size, placements: Any, mesh: DeviceMesh) -> tuple[int, ...]:
    """The offset of this rank's piece in each dimension: Shard(d) splits dimension d as torch.chunk does."""
    offsets = [0] * len(shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            dim, size = placement.dim, mesh.size(mesh_dim)
            chunk = math.ceil(shape[dim] / size)
            offsets[dim] += chunk * mesh.get_local_rank(mesh_dim)
    return tuple(offsets)


# ---- checkpoints: the local pieces in the full tensors' coordinates ----------------------------------------------
class TensorParallelState:
    """The engine's model or optimizer state (`ModelShards`, `OptimizerShards`) as checkpoints hold it under tensor
    parallel: by the model's names, in the full tensors' shapes. Each rank's pieces of a split parameter are put
    at their place in the full tensor; what every tensor-parallel rank holds alike (replicated parameters, buffers,
    an optimizer's step) is written by the first of them and read by all. So a checkpoint written under one layout
    loads under any other, with or without tensor parallel.

    Args:
        inner: the engine's owner of the state, in local coordinates.
        parameters: the model's tensor-parallel parameters.
    """

    def __init__(self, inner: Any, parameters: TensorParallelParameters) -> None:
        self.inner, self.layouts = inner, parameters.layouts
        self.first = parameters.mesh.get_local_rank() == 0  # writes what the tensor-parallel ranks share

    def __getattr__(self, name: str) -> Any:  # module, writes_pieces, aliases: the inner owner's
        return getattr(self.inner, name)

    def state_dict(self) -> dict[str, Any]:
        return self._full(self.inner.state_dict(), writing=True)

    def load_targets(self, saved: dict[str, Any]) -> dict[str, Any]:
        return self._full(self.inner.load_targets(self._local(saved)), writing=False)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        layouts = self.layouts
        return {n: (layouts[n].shape if n in layouts else s, dtype) for n, (s, dtype) in self.inner.shapes().items()}

    def in_full_coordinates(self, entries: dict[str, Any], writing: bool) -> dict[str, Any]:
        """Other state kept in the model's pieces, by parameter name (a callback's average of the weights), as
        checkpoints hold it: see the class."""
        return self._entries(None, entries, writing)

    def _full(self, state: dict[str, Any], writing: bool) -> dict[str, Any]:
        """Model entries (name -> value) or an optimizer's ({"state": {name: {key: value}}, ...}) in full
        coordinates; when `writing`, without what another tensor-parallel rank writes."""
        if "state" in state and isinstance(state["state"], dict):  # an optimizer's
            entries = {name: self._entries(name, values, writing) for name, values in state["state"].items()}
            return {**state, "state": {name: values for name, values in entries.items() if values}}
        return self._entries(None, state, writing)

    def _entries(self, name: str | None, values: dict[str, Any], writing: bool) -> dict[str, Any]:
        out = {}
        for key, value in values.items():
            layout = self.layouts.get(key if name is None else name)
            split = layout is not None and not layout.replicated
            # (the state of an optimizer that steps whole tensors is of the unsplit tensor's shape already)
            if isinstance(value, FlatPieces) and split and tuple(value.shape) != tuple(layout.shape):
                out[key] = to_full_coordinates(value, layout)
            elif self.first or not writing:  # the same on every tensor-parallel rank: written once
                out[key] = value
        return out

    def _local(self, saved: dict[str, Any]) -> dict[str, Any]:
        """What the checkpoint holds, with each split parameter's element-wise optimizer state as meta tensors of
        the local piece's shape (the engine installs state of its pieces' shapes)."""
        if not isinstance(saved.get("state"), dict) or getattr(self.inner, "steps_whole_tensors", False):
            return saved  # (an optimizer that steps whole tensors keeps state of the unsplit tensors' shapes)
        state = {}
        for name, values in saved["state"].items():
            layout = self.layouts.get(name)
            if layout is None or layout.replicated:
                state[name] = values
                continue
            state[name] = {
                key: torch.empty(layout.local_shape, dtype=v.dtype, device="meta")
                if isinstance(v, torch.Tensor) and v.shape == layout.shape
                else v
                for key, v in values.items()
            }
        return {**saved, "state": state}


def to_full_coordinates(pieces: FlatPieces, layout: TensorParallelLayout) -> FlatPieces:
    """The same slices, as flat ranges of the full tensor: a range of the local piece stays one range of the full
    tensor as long as it does not cross the end of a row of the innermost split dimension."""
    local_shape, shape = tuple(layout.local_shape), tuple(layout.shape)
    whole = len(shape)
    while whole > 0 and local_shape[whole - 1] == shape[whole - 1]:
        whole -= 1  # dimensions whole..end are held whole
    run = math.prod(local_shape[max(whole - 1, 0) :])  # elements contiguous in the full tensor too
    out = []
    for start, data in pieces.pieces:
        position, end = start, start + data.numel()
        while position < end:
            stop = min(end, (position // run + 1) * run)
            index = [i + o for i, o in zip(_unravel(position, local_shape), layout.offsets)]
            out.append((_ravel(index, shape), data[position - start : stop - start]))
            position = stop
    return FlatPieces(layout.shape, pieces.dtype, out)


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    index = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size)
        index.append(rest)
    return index[::-1]


def _ravel(index: list[int], shape: tuple[int, ...]) -> int:
    flat = 0
    for i, size in zip(index, shape):
        flat = flat * size + i
    return flat
