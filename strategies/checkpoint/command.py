"""python -m trainer.checkpoint: consolidate a checkpoint into one plain file, or export its weights to
safetensors in HuggingFace's layout."""

from __future__ import annotations

import argparse

from .export import consolidate, export_safetensors

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _size(text: str) -> int:
    number = text.rstrip("KMGIBkmgib")
    unit = text[len(number) :].upper()
    if unit not in SIZE_UNITS or not number.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use bytes or a unit such as 5GB or 500MiB")
    return int(number) * SIZE_UNITS[unit]


def main(argv: list[str] | None = None) -> None:
    """The command line `python -m trainer.checkpoint`: `consolidate CHECKPOINT OUT [--with-optimizer]` (see
    `consolidate`) and `export CHECKPOINT OUT_DIR [--prefix P] [--max-shard-size 5GB] [--ema] [--trainable-only]`
    (see `export_safetensors`); both take `--trust-pickled` (see `trust_pickled` there).

    Args:
        argv: the arguments; `None` for `sys.argv[1:]`.
    """
    what = " ".join(__doc__.split()).split(": ", 1)[1]  # the docstring's sentence, without the command
    parser = argparse.ArgumentParser(prog="python -m trainer.checkpoint", description=what)
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("consolidate", help="write a checkpoint as one plain torch.load file")
    merge.add_argument("checkpoint")
    merge.add_argument("out")
    merge.add_argument(
        "--with-optimizer",
        action="store_true",
        help="everything: model, optimizer state keyed by name, trainer state (a full checkpoint)",
    )
    export = commands.add_parser("export", help="write a checkpoint's weights in another format")
    export.add_argument("checkpoint")
    export.add_argument("out_dir")
    export.add_argument("--format", choices=["safetensors"], default="safetensors")
    export.add_argument("--prefix", default="", help="strip this from every name (e.g. 'model.'); others are left out")
    export.add_argument(
        "--max-shard-size",
        type=_size,
        default="5GB",
        help="above this, shards and model.safetensors.index.json (default 5GB)",
    )
    export.add_argument(
        "--ema", action="store_true", help="the moving average of callbacks.EMA instead of the trained weights"
    )
    export.add_argument(
        "--trainable-only",
        action="store_true",
        help="only the parameters that were trained (requires_grad), e.g. a LoRA adapter",
    )
    for command in (merge, export):
        command.add_argument(
            "--trust-pickled",
            action="store_true",
            help="unpickle whatever the checkpoint holds, not only tensors and plain data: only for "
            "a checkpoint whose writer you trust (unpickling can run code)",
        )
    args = parser.parse_args(argv)
    try:
        _run(args)
    except (ValueError, OSError) as error:  # a checkpoint that is not there or not what was asked: say so, briefly
        parser.exit(2, f"{parser.prog} {args.command}: error: {error}\n")


def _run(args: argparse.Namespace) -> None:
    if args.command == "consolidate":
        consolidate(args.checkpoint, args.out, with_optimizer=args.with_optimizer, trust_pickled=args.trust_pickled)
        print(f"wrote {args.out}")
        return
    left_out = export_safetensors(
        args.checkpoint,
        args.out_dir,
        args.prefix,
        args.max_shard_size,
        ema=args.ema,
        trainable_only=args.trainable_only,
        trust_pickled=args.trust_pickled,
    )
    note = f" (left out, not under {args.prefix!r}: {', '.join(left_out)})" if left_out else ""
    print(f"wrote {args.out_dir}{note}")
