"""The oldest torch the project supports (pyproject.toml says the same): 2.11."""

from __future__ import annotations

import torch

OLDEST_TORCH = (2, 11)


def check_torch_version(version: str = torch.__version__) -> None:
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    if release < OLDEST_TORCH:
        raise ImportError(
            f"shardtrain needs torch >= {'.'.join(map(str, OLDEST_TORCH))} (its DCP checkpoints, "
            f"torch.distributed and FSDP2 APIs); this environment has torch {version}"
        )


check_torch_version()
