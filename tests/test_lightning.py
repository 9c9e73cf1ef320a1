"""A LightningModule moves over with only its imports changed: Lightning's names, forms and habits work here.

The modules below are written as Lightning's demos and documentation write them (BoringModel, a GAN with manual
optimization, ReduceLROnPlateau on a validation metric, a DataModule); only the imports point at this project.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

from trainer.hparams import AttributeDict
from trainer.optimizers import normalize


def _opt(n: int = 1) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1) for _ in range(n)]


def test_configure_optimizers_accepts_every_lightning_form():
    (a, b) = _opt(2)
    sa, sb = StepLR(a, 1), StepLR(b, 1)
    plateau = ReduceLROnPlateau(a)
    cases = {
        "optimizer": (a, [a], []),
        "list": ([a, b], [a, b], []),
        "tuple": ((a, b), [a, b], []),
        "two lists": (([a, b], [sa, sb]), [a, b], [(sa, 0), (sb, 1)]),
        "lists with a config dict": (([a], [{"scheduler": sa, "interval": "step"}]), [a], [(sa, 0)]),
        "dict": ({"optimizer": a, "lr_scheduler": sa}, [a], [(sa, 0)]),
        "dict with config": ({"optimizer": a, "lr_scheduler": {"scheduler": plateau, "monitor": "val/loss"}},
                             [a], [(plateau, 0)]),
        "dict monitor outside": ({"optimizer": a, "lr_scheduler": plateau, "monitor": "val/loss"}, [a],
                                 [(plateau, 0)]),
        "list of dicts": ([{"optimizer": a, "lr_scheduler": sa}, {"optimizer": b}], [a, b], [(sa, 0)]),
        "pair (this project's older form)": ((a, sa), [a], [(sa, 0)]),
    }
    for name, (returned, optimizers, schedulers) in cases.items():
        got_optimizers, configs = normalize(returned)
        assert got_optimizers == optimizers, name
        assert [(c.scheduler, c.optimizer_index) for c in configs] == schedulers, name
    step_config = normalize(([a], [{"scheduler": sa, "interval": "step", "frequency": 3}]))[1][0]
    assert (step_config.interval, step_config.frequency) == ("step", 3)


@pytest.mark.parametrize("returned, error, match", [
    (lambda a: [a, "sgd", a], TypeError, "configure_optimizers must return"),
    (lambda a: [a, "sgd"], TypeError, "not a learning-rate scheduler"),
    (lambda a: {"optimizer": a, "lr_scheduler": ReduceLROnPlateau(a)}, ValueError, "ReduceLROnPlateau needs"),
    (lambda a: {"optimizer": a, "scheduler": StepLR(a, 1)}, ValueError, "unknown keys"),
    (lambda a: {"optimizer": a, "lr_scheduler": {"scheduler": StepLR(a, 1), "interval": "batch"}}, ValueError,
     "interval='batch'"),
    (lambda a: None, TypeError, "configure_optimizers must return"),
])
def test_configure_optimizers_refuses_what_it_cannot_read(returned, error, match):
    with pytest.raises(error, match=match):
        normalize(returned(_opt()[0]))


def test_hparams_are_read_as_attributes_and_taken_from_init():
    from trainer import TrainModule

    class Model(TrainModule):
        def __init__(self, hidden_dim: int = 8, lr: float = 0.1, **extra) -> None:
            super().__init__()
            self.save_hyperparameters()

    class Wider(Model):
        def __init__(self, width: int = 4, **kwargs) -> None:
            super().__init__(**kwargs)

    model = Model(16, dropout=0.5)
    assert model.hparams == {"hidden_dim": 16, "lr": 0.1, "dropout": 0.5}
    assert model.hparams.hidden_dim == 16 and isinstance(model.hparams, AttributeDict)
    assert Wider(width=2, lr=0.3).hparams == {"width": 2, "hidden_dim": 8, "lr": 0.3}  # the subclasses' too
    with pytest.raises(AttributeError, match="no hyperparameter 'depth'"):
        _ = model.hparams.depth

    class Named(TrainModule):
        def __init__(self, a: int, b: int = 2, c: object = None) -> None:
            super().__init__()
            self.save_hyperparameters("a", "b")

    assert Named(1).hparams == {"a": 1, "b": 2}

    class FromNamespace(TrainModule):
        def __init__(self, args: argparse.Namespace) -> None:
            super().__init__()
            self.save_hyperparameters(args, ignore=["seed"])

    assert FromNamespace(argparse.Namespace(lr=0.2, seed=1)).hparams == {"lr": 0.2}
