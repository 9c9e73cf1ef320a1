"""Seeding every random number generator a training run touches."""

from __future__ import annotations

import os
import random

import torch


def seed_everything(seed: int = 0) -> int:
    """Seed Python's `random`, NumPy (if installed) and torch on this process.

    The seed is also kept in the environment variable `PL_GLOBAL_SEED`, from which the Trainer seeds the
    `DistributedSampler` it puts in the loaders, and from which every strategy but `"single"` seeds every generator
    again at the start of each fit, validate, test and predict, on every rank (as Lightning's ddp and fsdp do).

    Args:
        seed: the seed.

    Returns:
        The seed.

    Raises:
        TypeError: if `seed` is not an int.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed_everything: seed must be an int, got {seed!r}")
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    return seed


def reset_seed() -> None:
    """Seed every generator again from the seed `seed_everything` last set (kept in `PL_GLOBAL_SEED`); nothing when
    none was set. Lightning's ddp and fsdp strategies do this on every rank when they set up the process group, at
    the start of each fit, validate, test and predict, so the stage's hooks (`configure_model`, a
    `train_dataloader` that draws random data) see the same random state whatever ran before them."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    if seed is not None:
        seed_everything(int(seed))


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        name, keys, position, has_gauss, cached_gaussian = numpy.random.get_state()
        # plain ints rather than an ndarray: torch.load(weights_only=True) then reads a full checkpoint
        state["numpy"] = (name, keys.tolist(), position, has_gauss, cached_gaussian)
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


class RandomState:
    """This process's random number generators (Python's, torch's, CUDA's, numpy's) as a checkpoint's per-rank
    entry (strategies/checkpoint/stateful.py)."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state_dict: dict) -> None:
        set_rng_state(state_dict)
