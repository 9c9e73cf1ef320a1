"""Trainer state and what moves in and out of checkpoints."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import checkpoint as ckpt_io
from .seed import rng_state, set_rng_state

if TYPE_CHECKING:
    from .trainer import Trainer

@dataclass
class TrainerState:
    stage: str = "fit"
    epoch: int = 0
    global_step: int = 0
    batches_done_in_epoch: int = (
        0  # micro-batches of the current epoch already trained (for mid-epoch resume)
    )


def move_to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [move_to_device(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    return batch


def checkpoint_state(trainer: Trainer) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """(this rank's file contents, rank 0's trainer state, metadata) for a checkpoint of `trainer` now."""
    strategy = trainer.strategy
    rank_state = {
        "model": strategy.model_state_pieces(),
        "optimizers": [strategy.optimizer_state_pieces(opt) for opt in trainer.optimizers],
        "rng": rng_state(),
    }
    trainer_state = _trainer_state(trainer) if trainer.is_global_zero else None
    return rank_state, trainer_state, _meta(trainer)


def write_full_checkpoint(trainer: Trainer, path: str) -> None:
    """Write the full-file checkpoint (see trainer/checkpoint.py) at `path` from rank 0. Collective.
    Two passes, unit by unit: first the file's layout (rank 0 keeps only uninitialised placeholders of each
    tensor's shape and dtype; the optimizer state is gathered to learn them, the weights' are known), then the
    bytes, which rank 0 writes into the file as each unit arrives. So no rank holds more than about one unit of
    the model and its optimizer state at a time."""
    skeleton, placeholders = full_checkpoint(trainer, placeholders=True)
    writer = ckpt_io.StreamedFullFile(path, skeleton, placeholders) if trainer.is_global_zero else None
    del skeleton
    try:
        for key, value in _gathered_state(trainer):
            if isinstance(value, torch.Tensor):
                writer.fill(key, value)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.commit()
    trainer.strategy.barrier()


def full_checkpoint(trainer: Trainer, placeholders: bool = False) -> tuple[dict[str, Any] | None, set[tuple]]:
    """The checkpoint in the full-file layout on rank 0 (None on the others), and the keys of its gathered
    tensors. Collective. With `placeholders`, the gathered tensors are uninitialised tensors of their shape and
    dtype: the weights' are known without gathering, the optimizer state's are replaced as each unit arrives."""
    state_dict: dict[str, Any] = {}
    optimizers: list[dict[str, Any]] = [{"state": {}} for _ in trainer.optimizers]
    keys: set[tuple] = set()
    if placeholders and trainer.is_global_zero:
        aliases = trainer.strategy.parameter_aliases()
        for name, (shape, dtype) in trainer.strategy.full_state_shapes().items():
            if name not in aliases:
                state_dict[name] = torch.empty(shape, dtype=dtype)  # untouched memory: not resident
                keys.add(("state_dict", name))
    for key, value in _gathered_state(trainer, weights=not placeholders):
        if key[0] == "optimizers" and len(key) == 2:
            optimizers[key[1]].setdefault("header", value)
            continue
        if placeholders and isinstance(value, torch.Tensor):
            value = torch.empty(value.shape, dtype=value.dtype)  # untouched memory: not resident
            keys.add(key)
        if key[0] == "state_dict":
            state_dict[key[1]] = value
        else:
            optimizers[key[1]]["state"].setdefault(key[3], {})[key[4]] = value
    rngs = trainer.strategy.all_gather_object(rng_state())
    if not trainer.is_global_zero:
        return None, set()
    for alias, first in trainer.strategy.parameter_aliases().items():
        state_dict[alias] = state_dict[first]  # the same tensor: tied entries share their storage in the file
        if ("state_dict", first) in keys:
            keys.add(("state_dict", alias))
    order = _state_dict_order(trainer)
    checkpoint = {
        "state_dict": {k: state_dict[k] for k in order},
        "optimizers": [_full_optimizer(opt, order) for opt in optimizers],
        "trainer": _trainer_state(trainer),
        "rng": rngs,
        "meta": {"format_version": ckpt_io.FORMAT_VERSION, "world_size": trainer.world_size, **_meta(trainer)},
    }
    return checkpoint, keys


def _gathered_state(trainer: Trainer, weights: bool = True) -> Iterator[tuple[tuple, Any]]:
    """Collective. On rank 0, unit by unit: (("state_dict", name), value) for every state-dict entry (tied
    aliases left out; skipped unless `weights`), (("optimizers", i), {"class", "param_groups"}) for each
    optimizer once per unit, and (("optimizers", i, "state", name, key), value) for its state. The other ranks
    get nothing but must iterate."""
    strategy = trainer.strategy
    for part in strategy.iter_full_state_dict(rank_zero_only=True) if weights else []:
        for name, value in part.items():
            yield ("state_dict", name), value
    order = _state_dict_order(trainer)
    for i, optimizer in enumerate(trainer.optimizers):
        for per_rank in strategy.gather_optimizer_state_pieces(optimizer):
            if per_rank is None:
                continue  # not rank 0
            part = ckpt_io.full_optimizer_state(per_rank, order)
            yield ("optimizers", i), {"class": part["class"], "param_groups": part["param_groups"]}
            for name, entries in part["state"].items():
                for key, value in entries.items():
                    yield ("optimizers", i, "state", name, key), value


def _state_dict_order(trainer: Trainer) -> list[str]:
    return list(trainer.module.state_dict(keep_vars=True))


def _full_optimizer(gathered: dict[str, Any], order: list[str]) -> dict[str, Any]:
    header = gathered.get("header", {"class": None, "param_groups": []})
    state = {name: gathered["state"][name] for name in order if name in gathered["state"]}
    return {"class": header["class"], "state": state, "param_groups": header["param_groups"]}


def _trainer_state(trainer: Trainer) -> dict[str, Any]:
    """Rank 0's part of a checkpoint; calls the on_save_checkpoint hooks."""
    extra: dict[str, Any] = {}
    trainer.module.on_save_checkpoint(extra)
    callbacks = {}
    for cb in trainer.callbacks:
        cb.on_save_checkpoint(trainer, trainer.module, extra)
        callbacks[cb.state_key] = cb.state_dict()
    return {
        "state": asdict(trainer.state),
        "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
        "callbacks": callbacks,
        "precision": trainer.precision.state_dict(),
        "hparams": dict(trainer.module.hparams),
        "module_extra": extra,
    }


def _meta(trainer: Trainer) -> dict[str, Any]:
    return {
        "strategy": repr(trainer.strategy),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "aliases": trainer.strategy.parameter_aliases(),
        "state_dict_keys": list(trainer.module.state_dict(keep_vars=True)),
    }


def restore_checkpoint(trainer: Trainer, path: str, weights_only: bool) -> None:
    """Load a checkpoint directory or full file into `trainer`, after checking that all of it fits."""
    checkpoint = ckpt_io.load_checkpoint(path, weights_only)
    if not weights_only and "trainer" not in checkpoint:
        raise ValueError(
            f"ckpt_path={path!r} holds weights only; fit resumes from a checkpoint directory or from a file "
            "written by trainer.save_checkpoint(path, full=True)"
        )
    check_compatible(trainer, checkpoint, path, weights_only)
    trainer.strategy.load_model_state(checkpoint["state_dict"])
    if weights_only:
        return
    for optimizer, saved in zip(trainer.optimizers, checkpoint["optimizers"]):
        trainer.strategy.load_optimizer_state(optimizer, saved["state"], saved["param_groups"])
    saved = checkpoint["trainer"]
    for cfg, sched_state in zip(trainer.lr_scheduler_configs, saved["lr_schedulers"]):
        cfg.scheduler.load_state_dict(sched_state)
    for key, value in saved["state"].items():
        setattr(trainer.state, key, value)
    trainer.precision.load_state_dict(saved["precision"])
    for cb in trainer.callbacks:
        if cb.state_key in saved["callbacks"]:
            cb.load_state_dict(saved["callbacks"][cb.state_key])
        cb.on_load_checkpoint(trainer, trainer.module, saved["module_extra"])
    trainer.module.on_load_checkpoint(saved["module_extra"])
    rngs = checkpoint["rng"]
    if checkpoint["meta"]["world_size"] == trainer.world_size and len(rngs) > trainer.global_rank:
        set_rng_state(rngs[trainer.global_rank])


def check_compatible(trainer: Trainer, checkpoint: dict[str, Any], path: str, weights_only: bool = False) -> None:
    """Every difference between the checkpoint and the model (and, unless `weights_only`, its optimizers),
    listed at once in one ValueError."""
    expected = trainer.strategy.full_state_shapes()
    model_state = checkpoint["state_dict"]
    missing, unexpected = set(expected) - set(model_state), set(model_state) - set(expected)
    problems = [f"missing: {key}" for key in sorted(missing)]
    problems += [f"unexpected: {key}" for key in sorted(unexpected)]
    for key in sorted(set(expected) & set(model_state)):
        shape, dtype = expected[key]
        if list(model_state[key].shape) != list(shape):
            problems.append(f"shape of {key}: checkpoint {list(model_state[key].shape)}, model {list(shape)}")
        elif model_state[key].dtype != dtype:
            problems.append(f"dtype of {key}: checkpoint {model_state[key].dtype}, model {dtype}")
    if not weights_only:
        reported = missing | unexpected
        problems += _optimizer_problems(trainer, checkpoint["optimizers"], reported)
    if problems:
        raise ValueError(f"ckpt_path={path!r} does not fit this model:\n  " + "\n  ".join(problems))


def _optimizer_problems(trainer: Trainer, saved: list[dict[str, Any]], reported: set[str]) -> list[str]:
    """Differences in optimizer count, class, group count and the parameters of each group (names already
    reported as missing or unexpected in the model are not repeated)."""
    if len(saved) != len(trainer.optimizers):
        return [f"optimizers: checkpoint {len(saved)}, module {len(trainer.optimizers)}"]
    problems = []
    for i, (optimizer, names, ckpt) in enumerate(zip(trainer.optimizers, trainer.param_group_names, saved)):
        kind = type(optimizer).__name__
        if ckpt.get("class") != kind:
            problems.append(f"class of optimizer {i}: checkpoint {ckpt.get('class')}, module {kind}")
        groups = ckpt["param_groups"]
        if len(groups) != len(names):
            problems.append(f"parameter groups of optimizer {i}: checkpoint {len(groups)}, module {len(names)}")
            continue
        for j, (group, group_names) in enumerate(zip(groups, names)):
            ours, theirs = set(group_names) - reported, set(group["param_names"]) - reported
            problems += [f"missing in optimizer {i} group {j}: {n}" for n in sorted(ours - theirs)]
            problems += [f"unexpected in optimizer {i} group {j}: {n}" for n in sorted(theirs - ours)]
    return problems
