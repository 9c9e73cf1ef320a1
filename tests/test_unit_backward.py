"""fsdp's backward per unit (docs/architecture.md, "Backward"): a wrapped unit is told once that its gradients are
in, when its backward is over, and falls back to a hook per parameter where that moment is not the end of its
gradients: a unit called twice, one whose inputs need no gradient, one recomputed by reentrant checkpointing, one
whose parameter is read outside it. Each such model trains at 2 ranks exactly as one process on the global batch.

Bodies named `body_*` run on every rank of the session's gloo pool.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from strategies.sharding import FULL_SHARD, ShardingEngine, gradients
from tests.test_parity import max_relative_difference

WIDTH, TOKENS, ROWS, STEPS, ACCUMULATE = 6, 9, 4, 3, 2
WORLD = 2
CASES = {  # case: (units told once, by name; reshard_after_forward)
    "plain": ({"units.0", "units.1", "units.2"}, True),
    "inputs need no gradient": ({"units.1", "units.2"}, True),
    "unit called twice": ({"units.0", "units.2"}, True),
    "unit no loss reaches": ({"units.0", "units.1", "units.2"}, True),
    "parameter shared by two units": ({"units.0", "units.1", "units.2"}, True),
    "parameter read outside its unit": ({"units.0", "units.1", "units.2"}, False),
    "output used outside": ({"units.0", "units.1", "units.2"}, True),
    "frozen parameter": ({"units.0", "units.1", "units.2"}, True),
    "checkpointed": ({"units.0", "units.1", "units.2"}, True),
    "checkpointed, reentrant": (set(), True),
    "retain_graph, two backwards": ({"units.0", "units.1", "units.2"}, True),
    "input changed in place": ({"units.1", "units.2"}, True),
}


class Unit(nn.Module):
    def __init__(self, layers: int = 1, in_place: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.in_place = in_place

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.in_place:  # (its input's autograd history is rewritten: the unit's backward cannot end on it)
            h = h.mul_(2.0)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


class Net(nn.Module):
    """An embedding and a head (in the root unit), three wrapped units and one never called; `case` picks how the
    forward uses them."""

    def __init__(self, case: str, layers: int = 1) -> None:
        super().__init__()
        self.case = case
        self.emb = nn.Embedding(TOKENS, WIDTH)
        self.units = nn.ModuleList(Unit(layers, in_place=case == "input changed in place" and i == 0) for i in range(3))
        self.spare = Unit(layers)
        self.head = nn.Linear(WIDTH, 1)
        if case == "parameter shared by two units":
            self.units[2].layers[0].weight = self.units[0].layers[0].weight
        if case == "frozen parameter":
            self.units[1].layers[0].bias.requires_grad_(False)

    def forward(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        case, units = self.case, self.units
        h = x if case == "inputs need no gradient" else self.emb(tokens)
        if case.startswith("checkpointed"):
            for unit in units:
                h = checkpoint(unit, h, use_reentrant=case.endswith("reentrant"))
            return self.head(h)
        first = h = units[0](h)
        h = units[1](h)
        if case == "unit called twice":
            h = units[1](h)
        if case == "unit no loss reaches":
            units[2](h)
        else:
            h = units[2](h)
        out = self.head(h)
        if case == "output used outside":
            out = out + self.head(first)
        if case == "parameter read outside its unit":
            out = out + 0.1 * (h @ units[0].layers[0].weight).sum(-1, keepdim=True)
        return out


def unit_policy(module: nn.Module, name: str) -> bool:
    return isinstance(module, Unit)


def batches(rank: int, world: int, micro: int, step: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s share of the global micro-batch (all ranks' rows when world is 1)."""
    g = torch.Generator().manual_seed(100 * step + micro)
    tokens = torch.randint(0, TOKENS, (ROWS * WORLD, 3), generator=g)
    x = torch.randn(ROWS * WORLD, 3, WIDTH, generator=g)
    y = torch.randn(ROWS * WORLD, 3, 1, generator=g)
    rows = slice(rank * ROWS * WORLD // world, (rank + 1) * ROWS * WORLD // world)
    return tokens[rows], x[rows], y[rows]


def train(model: Net, engine: ShardingEngine | None, rank: int, world: int) -> None:
    """STEPS optimizer steps of ACCUMULATE micro-batches, as a plain torch loop (the engine works from its hooks)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    if engine is not None:
        opt = engine.setup_optimizer(opt)
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            tokens, x, y = batches(rank, world, micro, step)
            loss = F.mse_loss(model(tokens, x), y) / ACCUMULATE
            if model.case == "retain_graph, two backwards":
                loss.backward(retain_graph=True)
            loss.backward()
        if engine is not None:
            gradients.clip_grad_norm_(engine, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


def body_train(case: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    torch.manual_seed(0)
    model = Net(case)
    engine = ShardingEngine(model, FULL_SHARD, wrap_policy=unit_policy, reshard_after_forward=CASES[case][1])
    train(model, engine, dist.get_rank(), dist.get_world_size())
    told_once = {unit.name for unit in engine.units if not unit.tracks_each_gradient and unit.name != "spare"}
    with engine.unsharded():
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return weights, told_once


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_backward_per_unit_trains_as_one_process(rank_pool, case):
    torch.manual_seed(0)
    reference = Net(case)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    train(reference, None, 0, 1)
    want = reference.state_dict()
    assert max_relative_difference(want, initial) > 1e-2  # the run moved the weights, or parity proves nothing
    for weights, told_once in rank_pool(WORLD).run(body_train, case):
        # (allclose, not the largest difference relative to a tensor's largest entry: head.bias is one number
        # near zero, where float32's rounding of the sums is a large fraction of it)
        torch.testing.assert_close(weights, dict(want), rtol=1e-5, atol=1e-6, msg=case)
        # The per-unit path is the one these numbers came through, where the case allows it.
        assert told_once == CASES[case][0], case


# ---------------------------------------------------------------------- Python work per unit, not per parameter


def body_library_calls_per_backward(layers: int) -> int:
    """How many times autograd calls into the library during one backward of a model whose units hold `layers`
    linear layers each: Python frames in strategies/ entered from outside it (from autograd's C++)."""
    torch.manual_seed(0)
    model = Net("plain", layers)
    engine = ShardingEngine(model, FULL_SHARD, wrap_policy=unit_policy)
    opt = engine.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    library = os.path.dirname(os.path.abspath(gradients.__file__)).rsplit(os.sep, 1)[0] + os.sep
    calls = 0

    def count(frame, event, _arg) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(library):
            caller = frame.f_back
            if caller is None or not caller.f_code.co_filename.startswith(library):
                calls += 1

    for step in range(2):  # the second step, with the prefetch order known
        tokens, x, y = batches(dist.get_rank(), dist.get_world_size(), 0, step)
        loss = F.mse_loss(model(tokens, x), y)
        calls = 0
        sys.setprofile(count)
        try:
            loss.backward()
        finally:
            sys.setprofile(None)
        opt.step()
        opt.zero_grad()
    return calls


def test_fsdp_calls_into_the_library_per_unit_not_per_parameter(rank_pool):
    """FSDP2 runs one post-backward per unit: the work autograd hands the library in backward must not grow with the
    parameters a unit holds (a hook per parameter did: 2 calls per parameter)."""
    pool = rank_pool(WORLD)
    small, large = (pool.run(body_library_calls_per_backward, layers)[0] for layers in (1, 6))
    assert small == large, (small, large)
