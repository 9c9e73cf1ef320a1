"""python -m strategies.plan MODULE:FACTORY [options]: the memory plan of a model, without building it."""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable

import torch
from torch import nn

from .activations import AUTOCAST
from .compute import AC_MODES
from .hardware import HARDWARE, get_hardware
from .model_bytes import OPTIMIZER_STATES
from .planner import plan_memory
from .sizes import device_memory_per_rank, parse_bytes

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PRECISIONS = tuple(AUTOCAST)


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="python -m strategies.plan",
        description="Bytes per rank (parameters, gradients, optimizer state, units in flight, activations) under "
        "ddp, zero1, zero2 and fsdp, for a model built on the meta device: no memory, seconds even at 70B.",
    )
    p.add_argument(
        "target",
        metavar="MODULE:FACTORY",
        help="an importable module and a zero-argument callable in it returning an nn.Module or a "
        "TrainModule, e.g. examples.gpt:gpt_100m or examples.llama:llama_7b",
    )
    p.add_argument("--world-size", type=int, default=1, help="ranks in all (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the ranks are spread over (default 1)")
    p.add_argument(
        "--hybrid-shard",
        type=int,
        metavar="G",
        help="also plan hsdp: fsdp sharded within groups of G "
        "ranks, replicated across them (default with --nodes > 1: the ranks of one node)",
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="split each group of N consecutive ranks with torch's tensor parallel (the strategies then shard "
        "over world-size / N data-parallel ranks); default 1",
    )
    p.add_argument(
        "--context-parallel",
        type=int,
        default=1,
        metavar="C",
        help="split each sequence over C ranks that read the same samples (Ulysses); --seq-len is the whole "
        "sequence's; default 1",
    )
    p.add_argument(
        "--pipeline-parallel",
        type=int,
        default=1,
        metavar="P",
        help="cut the model into P pipeline stages, one rank's each (--batch-size is a pipeline's batch); default 1",
    )
    p.add_argument("--pipeline-schedule", default="1F1B", help="with --pipeline-parallel: torch's schedule's name")
    p.add_argument(
        "--pipeline-microbatches", type=int, metavar="M", help="micro-batches per batch (default: one per stage)"
    )
    p.add_argument(
        "--tensor-parallel-plan",
        metavar="MODULE:FUNCTION",
        help="with --tensor-parallel: a function of the model returning its plan, {module path: ParallelStyle}, "
        "as parallelize_module takes it (default: tensor_parallel_plan in the target's module, e.g. "
        "examples.llama:tensor_parallel_plan)",
    )
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank (default 1)")
    p.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sequence (default: the model config's block_size, max_seq_len or max_position_embeddings)",
    )
    p.add_argument("--precision", default="32", choices=PRECISIONS, help="the Trainer's precision (default 32)")
    p.add_argument(
        "--param-dtype",
        choices=sorted(DTYPES),
        help="MixedPrecision(param_dtype=...): compute and "
        "communicate parameters in this dtype, with fp32 master weights and optimizer state",
    )
    p.add_argument(
        "--reduce-dtype", choices=sorted(DTYPES), help="MixedPrecision(reduce_dtype=...) (default: the param dtype)"
    )
    p.add_argument(
        "--device-memory",
        help="memory per rank, e.g. 80GiB (default: the free memory of GPU 0, or "
        "on CPU this machine's memory shared by the ranks of one node)",
    )
    p.add_argument(
        "--optimizer",
        choices=list(OPTIMIZER_STATES),
        help="(default: what the module's configure_optimizers returns, else adamw)",
    )
    p.add_argument(
        "--wrap",
        metavar="CLASSNAME[,CLASSNAME]",
        help="module classes whose instances become fsdp units, "
        "e.g. Block; transformer blocks cannot be guessed, so without it the whole model is one unit",
    )
    p.add_argument(
        "--activation-checkpointing",
        metavar="CLASSNAME[,CLASSNAME]",
        help="module classes whose activations are recomputed in backward (they keep only their inputs)",
    )
    p.add_argument(
        "--ac-mode",
        choices=AC_MODES,
        default="full",
        help="full: checkpointed modules recompute "
        "everything (as the engine does); selective: plan torchtitan's per-op policy (matmul outputs "
        "saved every other one, attention outputs saved), in memory and time",
    )
    p.add_argument(
        "--hardware",
        metavar="NAME|FILE",
        help=f"the step-time forecast's profile: one of "
        f"{sorted(HARDWARE)} or a JSON file --save-hardware wrote (default: this machine's GPU kind, "
        "else cpu)",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="calibrate the profile on this machine first: matmul "
        "and memory rates, one step of the model, and a collectives sweep over real ranks; prints what "
        "it measured",
    )
    p.add_argument("--save-hardware", metavar="FILE", help="with --measure: write the measured profile here")
    p.add_argument("--json", action="store_true", help="print bytes per rank and the forecast by strategy as JSON")
    return p, p.parse_args(argv)


def load_callable(parser: argparse.ArgumentParser, option: str, target: str) -> Callable:
    """MODULE:NAME imported."""
    module_name, _, name = target.partition(":")
    if not module_name or not name:
        parser.error(f"{option}: {target!r} is not of the form MODULE:NAME, e.g. examples.gpt:gpt_100m")
    try:
        return getattr(importlib.import_module(module_name), name)
    except ImportError as error:
        parser.error(f"{option}: cannot import {module_name!r}: {error}")
    except AttributeError:
        parser.error(f"{option}: {module_name} has no {name!r}")


def tensor_parallel_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Callable | None:
    """The plan function --tensor-parallel uses: --tensor-parallel-plan, else the target module's
    tensor_parallel_plan."""
    if args.tensor_parallel_plan is not None:
        if args.tensor_parallel == 1:
            parser.error("--tensor-parallel-plan: give --tensor-parallel N (N > 1) too")
        return load_callable(parser, "--tensor-parallel-plan", args.tensor_parallel_plan)
    if args.tensor_parallel == 1:
        return None
    module_name = args.target.partition(":")[0]
    plan = getattr(importlib.import_module(module_name), "tensor_parallel_plan", None)
    if plan is None:
        parser.error(
            f"--tensor-parallel {args.tensor_parallel}: {module_name} has no tensor_parallel_plan; give "
            "--tensor-parallel-plan MODULE:FUNCTION (a function of the model returning its plan)"
        )
    return plan


def load_factory(parser: argparse.ArgumentParser, target: str) -> nn.Module:
    """Call MODULE:FACTORY on the meta device (configure_model too, for a TrainModule)."""
    factory = load_callable(parser, "MODULE:FACTORY", target)
    with torch.device("meta"):
        model = factory()
        if callable(getattr(model, "configure_model", None)):
            model.configure_model()
    if not isinstance(model, nn.Module):
        parser.error(f"MODULE:FACTORY: {target}() returned a {type(model).__name__}, not an nn.Module")
    return model


def class_policy(
    parser: argparse.ArgumentParser, model: nn.Module, option: str, names: str | None
) -> Callable[[nn.Module, str], bool] | None:
    """A policy selecting modules by class name; every name must be a class in the model."""
    if names is None:
        return None
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    present = {type(m).__name__ for m in model.modules()}
    if not wanted or wanted - present:
        parser.error(
            f"{option} {names}: no module of class {sorted(wanted - present)} in the model; "
            f"its classes are {sorted(present)}"
        )
    return lambda module, name: type(module).__name__ in wanted


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    model = load_factory(parser, args.target)
    plan_function = tensor_parallel_plan(parser, args)
    args.tensor_parallel_plan = plan_function  # (what --measure times tensor parallel with)
    if args.device_memory is not None:
        try:
            memory, where = parse_bytes(args.device_memory, "--device-memory"), "given"
        except ValueError as error:
            parser.error(str(error))
    elif args.nodes > 0 and args.world_size % args.nodes == 0:
        memory, where = device_memory_per_rank(args.world_size // args.nodes)
    else:
        memory, where = None, ""
    try:
        hardware = get_hardware(args.hardware) if args.hardware else None
        if args.measure:
            from .measure import measure_hardware  # starts ranks: only when asked

            hardware = measure_hardware(model, args, hardware)
        elif args.save_hardware:
            parser.error("--save-hardware: give --measure too (it saves what was measured)")
        plan = plan_memory(
            model,
            world_size=args.world_size,
            nodes=args.nodes,
            hybrid_shard=args.hybrid_shard,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            precision=args.precision,
            param_dtype=DTYPES.get(args.param_dtype),
            reduce_dtype=DTYPES.get(args.reduce_dtype),
            optimizer=args.optimizer,
            wrap_policy=class_policy(parser, model, "--wrap", args.wrap),
            activation_checkpointing=class_policy(
                parser, model, "--activation-checkpointing", args.activation_checkpointing
            ),
            device_memory=memory,
            hardware=hardware,
            checkpoint_mode=args.ac_mode,
            tensor_parallel=args.tensor_parallel,
            context_parallel=args.context_parallel,
            pipeline_parallel=args.pipeline_parallel,
            pipeline_schedule=args.pipeline_schedule,
            pipeline_microbatches=args.pipeline_microbatches,
            tensor_parallel_plan=plan_function,
        )
    except ValueError as error:
        parser.error(str(error))
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
        return
    plan.description[-1] += f" ({where})"
    print(plan.table())


if __name__ == "__main__":
    main()
