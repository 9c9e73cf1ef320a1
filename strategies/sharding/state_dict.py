"""Model and optimizer state by parameter name: what this rank writes of it, where it loads it, and the whole
model gathered unit by unit.

Every strategy writes the same thing: each parameter and its element-wise optimizer state as the flat slices of
the layout this rank owns (`FlatPieces`; under ddp, where every rank holds everything, the slices it would own),
so replicated state is written once, by all ranks in parallel, with nothing gathered (under hybrid sharding, by the
ranks of the first copy only). Loading gives each rank
the places its own state lives in: with sharded optimizer state (zero1, zero2, fsdp) its pieces of the master,
replicated parameters (zero1, zero2) being all-gathered afterwards (`after_parameters_changed`); under ddp whole
tensors. Tied parameters appear once, under their first name.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .engine import ShardingEngine
from .layout import FlatPieces
from .unit import ShardUnit
from .whole_tensors import WholeTensorSteps


def parameter_aliases(module: nn.Module) -> dict[str, str]:
    """State-dict keys of tied parameters that are not their first name: alias -> first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _other_entries(engine: ShardingEngine) -> dict[str, Any]:
    """The state-dict entries that are not parameters (buffers, extra state)."""
    params = {id(p) for p in engine.module.parameters()}
    aliases = parameter_aliases(engine.module)
    return {
        key: value
        for key, value in engine.module.state_dict(keep_vars=True).items()
        if id(value) not in params and key not in aliases
    }


def _owned_flat(unit: ShardUnit) -> torch.Tensor:
    """This rank's slice of the unit's flat parameters, in master precision."""
    if unit.spec.shard_optimizer_state:
        return unit.master
    lo, hi = unit.layout.shard_range(unit.rank)
    return unit.full_flat[lo:hi]


class MasterPiece(NamedTuple):
    """Elements [start, start + data.numel()) of the flattened parameter `name` of `shape` that this rank owns:
    `data` is a 1-D view of them in the master (writing it writes the weights the optimizer steps)."""

    name: str
    shape: torch.Size
    start: int
    data: torch.Tensor
    trainable: bool


def master_pieces(engine: ShardingEngine) -> list[MasterPiece]:
    """This rank's pieces of every parameter, in the master's precision: with sharded optimizer state (zero1,
    zero2, fsdp) the slices of the master its optimizer steps; under ddp the slices of the replicated parameters
    it would own, the ones it writes in checkpoints. Under hybrid sharding every copy holds its group's pieces."""
    out = []
    for unit in engine.units:
        flat = _owned_flat(unit)
        for piece in unit.pieces_by_rank[unit.rank]:
            index = piece.param_index
            data = flat[piece.shard_offset : piece.shard_offset + piece.numel]
            out.append(
                MasterPiece(
                    unit.param_names[index], unit.layout.shapes[index], piece.start, data, unit.trainable[index]
                )
            )
    return out


def _is_elementwise(key: str, value: Any, shape: torch.Size) -> bool:
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == shape


def _parameters_without_elements(engine: ShardingEngine) -> dict[str, torch.Tensor]:
    """Parameters with no elements, which no rank owns a piece of: written by rank 0, loaded by every rank."""
    return {
        name: torch.empty(shape, dtype=unit.dtype)
        for unit in engine.units
        for name, shape, numel in zip(unit.param_names, unit.layout.shapes, unit.layout.numels)
        if numel == 0
    }


# ---- what this rank writes -------------------------------------------------------------------------------
def model_pieces(engine: ShardingEngine) -> dict[str, Any]:
    """This rank's pieces of every parameter and, on rank 0, the other state-dict entries (buffers) and the
    parameters without elements (which no rank owns a piece of)."""
    out: dict[str, Any] = {}
    if engine.groups.replica != 0:  # hybrid sharding: another copy of the first group's pieces
        return out
    for piece in master_pieces(engine):
        out[piece.name] = FlatPieces(piece.shape, piece.data.dtype, [(piece.start, piece.data.detach())])
    if engine.rank == 0:
        out.update(_parameters_without_elements(engine))
        out.update({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in _other_entries(engine).items()})
    return out


def optimizer_pieces(
    engine: ShardingEngine, optimizer: torch.optim.Optimizer, group_names: list[list[str]]
) -> dict[str, Any]:
    """The optimizer's state as torch's `get_state_dict` keys it, {"state": {name: {key: value}}, "param_groups":
    [{hyperparameters, "params": names}]}, with this rank's pieces of the element-wise state (FlatPieces) and,
    from the rank holding a parameter's first element, its other state (such as `step`)."""
    sharded = engine.spec.shard_optimizer_state
    state: dict[str, dict[str, Any]] = {}
    whole = engine.whole_tensor_steps.get(id(optimizer))
    if whole is not None:
        state = _whole_tensor_state(engine, optimizer, whole) if engine.groups.replica == 0 else {}
    for unit in engine.units if engine.groups.replica == 0 and whole is None else []:  # hybrid: the first copy
        for piece in unit.pieces_by_rank[unit.rank]:
            index = piece.param_index
            target = unit.shard_params.get(index) if sharded else unit.params[index]
            shape = unit.layout.shapes[index]
            entries = {}
            for key, value in optimizer.state.get(target, {}).items():
                if _is_elementwise(key, value, target.shape):
                    flat = value.detach().reshape(-1)
                    flat = flat if sharded else flat[piece.start : piece.end]
                    entries[key] = FlatPieces(shape, value.dtype, [(piece.start, flat)])
                elif piece.start == 0:  # the same on every rank that holds a piece: written once
                    entries[key] = value.detach() if isinstance(value, torch.Tensor) else value
            if entries:
                state[unit.param_names[index]] = entries
    groups = [
        {**{k: v for k, v in group.items() if k not in ("params", "param_names")}, "params": list(names)}
        for group, names in zip(optimizer.param_groups, group_names)
    ]
    return {"state": state, "param_groups": groups}


def _whole_tensor_state(engine: ShardingEngine, optimizer: torch.optim.Optimizer, whole: WholeTensorSteps) -> dict:
    """The state of the parameters this rank steps whole: tensors of the parameter's shape as one piece covering
    all of it, the rest as it is. Without sharded optimizer state every rank steps everything: the first writes."""
    state: dict[str, dict[str, Any]] = {}
    for m in whole.owned() if engine.spec.shard_optimizer_state or engine.rank == 0 else []:
        entries = {}
        for key, value in optimizer.state.get(m.whole, {}).items():
            if _is_elementwise(key, value, m.shape):
                entries[key] = FlatPieces(m.shape, value.dtype, [(0, value.detach().reshape(-1))])
            else:
                entries[key] = value.detach() if isinstance(value, torch.Tensor) else value
        if entries:
            state[m.unit.param_names[m.index]] = entries
    return state


# ---- where this rank loads ---------------------------------------------------------------------------------
def model_targets(engine: ShardingEngine) -> dict[str, Any]:
    """Where this rank loads each state-dict entry it needs: FlatPieces of its master (sharded optimizer state)
    or of whole parameters (ddp), and the buffers themselves. Filled in place; then `after_parameters_changed`."""
    out: dict[str, Any] = {}
    if engine.spec.shard_optimizer_state:
        for piece in master_pieces(engine):
            out[piece.name] = FlatPieces(piece.shape, piece.data.dtype, [(piece.start, piece.data)])
    else:
        for unit in engine.units:
            for name, shape, offset, numel in zip(
                unit.param_names, unit.layout.shapes, unit.layout.offsets, unit.layout.numels
            ):
                out[name] = FlatPieces(shape, unit.dtype, [(0, unit.full_flat[offset : offset + numel])])
    out.update(_parameters_without_elements(engine))
    out.update({k: v.data for k, v in _other_entries(engine).items() if isinstance(v, torch.Tensor)})
    return out


def optimizer_targets(
    engine: ShardingEngine, optimizer: torch.optim.Optimizer, saved: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Install in `optimizer` the state `saved` describes for this rank's parameters (name -> key -> a meta
    tensor of the saved shape and dtype, or a value) and return the tensors to fill: FlatPieces of the
    element-wise state (this rank's pieces, or whole under ddp) and whole tensors of the rest."""
    sharded = engine.spec.shard_optimizer_state
    whole = engine.whole_tensor_steps.get(id(optimizer))
    targets: dict[str, dict[str, Any]] = {}
    for unit in engine.units:
        for index, name in enumerate(unit.param_names):
            if whole is not None:
                target, shape = whole.stepped_tensor(unit, index), whole.shape_of(unit, index)
            else:
                target = unit.shard_params.get(index) if sharded else unit.params[index]
                shape = unit.layout.shapes[index]
            if name not in saved or target is None:
                continue
            start = next(p.start for p in unit.pieces if p.param_index == index) if sharded and not whole else 0
            state, fill = {}, {}
            for key, value in saved[name].items():
                if _is_elementwise(key, value, shape):
                    state[key] = torch.empty(target.shape, dtype=value.dtype, device=target.device)
                    fill[key] = FlatPieces(value.shape, value.dtype, [(start, state[key].view(-1))])
                elif isinstance(value, torch.Tensor):
                    state[key] = fill[key] = torch.empty(value.shape, dtype=value.dtype)
                else:
                    state[key] = value
            optimizer.state[target] = state
            targets[name] = fill
    return targets


# ---- the whole model ---------------------------------------------------------------------------------------
def full_state_dict(engine: ShardingEngine, keep: bool = True, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict, gathered unit by unit (collective: every rank takes part; {} where `keep`
    is False, and nothing copied out there). With `trainable_only`, only the parameters that require grad (an
    adapter's): nothing else is gathered."""
    out: dict[str, torch.Tensor] = {}
    for names, views in engine.iter_full_parameters(trainable_only):  # under their first names; aliases below
        if keep:
            out.update({n: v.detach().cpu().clone() for n, v in zip(names, views)})
    if not keep:
        return {}
    if not trainable_only:
        for key, value in _other_entries(engine).items():  # buffers
            out[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    for alias, first in parameter_aliases(engine.module).items():
        if first in out:
            out[alias] = out[first]
    return {k: out[k] for k in engine.module.state_dict(keep_vars=True) if k in out}


def full_state_shapes(engine: ShardingEngine) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of every entry of the unwrapped model's state dict, without gathering anything."""
    params = {}
    for unit in engine.units:
        for name, shape in zip(unit.param_names, unit.layout.shapes):
            params[name] = (shape, unit.dtype)
    for alias, first in parameter_aliases(engine.module).items():
        params[alias] = params[first]
    out = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        out[key] = params.get(key) or (value.shape, value.dtype)
    return out


# ---- the engine's owners of checkpointed state (docs/architecture.md, "Checkpoints") ---------------------------
class ModelShards:
    """The model's state as the checkpoint component reads and writes it, by parameter name: `state_dict()` is
    what this rank writes (its pieces; nothing gathered), `load_targets` where it reads them in place under any
    world size, `load_state_dict` brings every copy of the parameters up to date afterwards."""

    def __init__(self, engine: ShardingEngine) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        return model_pieces(self.engine)

    def load_targets(self, saved: dict[str, Any]) -> dict[str, Any]:
        return model_targets(self.engine)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.after_parameters_changed()

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def writes_pieces(self) -> bool:
        """Whether this rank writes its pieces: under hybrid sharding only the first copy's ranks do (the others
        hold the same pieces)."""
        return self.engine.groups.replica == 0

    def aliases(self) -> dict[str, str]:
        """Names of tied parameters: each alias and the name it shares its tensor with."""
        return parameter_aliases(self.engine.module)

    def in_full_coordinates(self, entries: dict[str, Any], writing: bool) -> dict[str, Any]:
        """Other state kept in the model's pieces, by parameter name, as checkpoints hold it: as it is (the
        engine's pieces are already in the full tensors' coordinates)."""
        return entries

    def shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """The shape and dtype of every entry of the model's full state dict."""
        return full_state_shapes(self.engine)


class OptimizerShards:
    """An optimizer's state as the checkpoint component reads and writes it, keyed as torch's `get_state_dict`
    keys it: this rank's pieces of the element-wise state, the parameter groups (from rank 0) by parameter name."""

    def __init__(self, engine: ShardingEngine, optimizer: torch.optim.Optimizer, group_names: list[list[str]]) -> None:
        self.engine, self.optimizer, self.group_names = engine, optimizer, group_names
        self._saved_groups: list[dict[str, Any]] = []

    @property
    def steps_whole_tensors(self) -> bool:
        """Whether the optimizer steps whole tensors (whole_tensors.py): its state has the whole tensors' shapes,
        under tensor parallel too."""
        return id(self.optimizer) in self.engine.whole_tensor_steps

    def state_dict(self) -> dict[str, Any]:
        state = optimizer_pieces(self.engine, self.optimizer, self.group_names)
        if _global_rank() != 0:
            del state["param_groups"]  # the same on every rank: written once
        return state

    def load_targets(self, saved: dict[str, Any]) -> dict[str, Any]:
        """Install the saved state (`{"state": name -> key -> meta tensor or value, "param_groups": [...]}`) for
        this rank's parameters; return the tensors to fill."""
        groups = saved.get("param_groups", [])
        if isinstance(groups, dict):  # split by DCP under string indices
            groups = [groups[i] for i in sorted(groups, key=int)]
        self._saved_groups = list(groups)
        return {"state": optimizer_targets(self.engine, self.optimizer, saved.get("state", {}))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The state is filled: put the saved hyperparameters in each parameter group."""
        for group, saved_group in zip(self.optimizer.param_groups, self._saved_groups):
            group.update({k: v for k, v in saved_group.items() if k not in ("params", "param_names")})


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
