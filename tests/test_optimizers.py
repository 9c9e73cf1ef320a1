"""Any optimizer gives one process's numbers (docs/optimizers.md): element-wise ones step this rank's flat pieces,
those whose step reads a whole tensor (torch's Adafactor and Muon, LAMB, SOAP) step whole tensors of their own
shape that each rank owns, and those that read every tensor at once (LBFGS) run where every rank holds
everything, or are refused before the first step.

Each run is compared with one process of plain Trainer training on the global batch (tests/test_parity.py's
measure), with gradient accumulation and clipping on.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from pytorch_optimizer import SOAP, Lamb, Lion
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from strategies import DDPStrategy, FSDPStrategy, ZeroStrategy
from strategies.sharding.step_kind import KNOWN, StepKind, probe, step_kind
from tests.test_parity import fit, max_relative_difference
from trainer import Trainer, TrainModule

IN, HIDDEN, OUT = 16, 32, 4  # the first layer: a (32, 16) matrix and a (32,) bias, as users' MLPs have
PER_RANK_BATCH, STEPS, TOLERANCE = 2, 3, 1e-5


class OwnLamb(torch.optim.Optimizer):
    """LAMB as a user writes it in 30 lines: Adam's update scaled per tensor by ||w|| / ||update||."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"], state["m"], state["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = state["m"] / (1 - beta1 ** state["step"])
                v_hat = state["v"] / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update, alpha=-group["lr"] * float(trust))


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    params = list(params)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=0.05)
    if name == "muon":
        return torch.optim.Muon(params, lr=0.05)
    if name == "own-lamb":
        return OwnLamb(params)
    if name == "lamb":
        return Lamb(params, lr=0.01)
    if name == "soap":
        return SOAP(params, lr=0.01, precondition_frequency=2)
    if name == "lion":
        return Lion(params, lr=0.01)
    if name == "lbfgs":
        return torch.optim.LBFGS(params, lr=0.5, max_iter=4)
    raise ValueError(name)


class MLP(TrainModule):
    """Two linear layers; without biases for Muon alone (it steps matrices only)."""

    def __init__(self, optimizer: str = "adafactor", bias: bool = True) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.l1 = nn.Linear(IN, HIDDEN, bias=bias)
        self.l2 = nn.Linear(HIDDEN, OUT, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return make_optimizer(self.optimizer_name, self.parameters())


def new_mlp(optimizer: str, seed: int = 0, **kwargs) -> MLP:
    torch.manual_seed(seed)
    return MLP(optimizer, bias=optimizer != "muon", **kwargs)


def compared_dtype(optimizer: str) -> torch.dtype:
    """The dtype a run compared with one process trains in: float64 for Muon. Its step orthogonalises in bf16,
    where one float32 ulp of difference in a gradient (ranks sum it in another order than one process) moves the
    update by up to 10% (the Newton-Schulz steps blow up a small singular direction's rounding); a float64
    gradient's difference is far below bf16's rounding, so the step's bf16 input, and its result, are the same."""
    return torch.float64 if "muon" in optimizer else torch.float32


def compared_mlp(optimizer: str) -> MLP:
    return new_mlp(optimizer).to(compared_dtype(optimizer))


def dataset(samples: int = 48, dtype: torch.dtype = torch.float32) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(samples, IN, generator=g, dtype=torch.float64).to(dtype)
    return TensorDataset(x, torch.randint(0, OUT, (samples,), generator=g))


def per_layer(name: str):
    """A strategy by name; fsdp and hsdp make each linear layer a unit."""
    if name == "fsdp":
        return FSDPStrategy(auto_wrap_policy={nn.Linear})
    if name == "hsdp":
        return FSDPStrategy(auto_wrap_policy={nn.Linear}, hybrid_shard=2)
    if name == "zero2-hybrid":
        return ZeroStrategy(stage=2, hybrid_shard=2)
    return name


def run(
    module,
    strategy,
    devices: int,
    batch_size: int = PER_RANK_BATCH,
    accumulate: int = 2,
    clip: float | None = 0.5,
    steps: int = STEPS,
    ckpt_path: str | None = None,
    **kwargs,
) -> Trainer:
    """`steps` optimizer steps of `accumulate` batches each, clipped at norm `clip` (resumed from `ckpt_path`)."""
    data = dataset(dtype=module.built_dtype if isinstance(module, SplitMLP) else next(module.parameters()).dtype)
    options = dict(clip=clip, accumulate=accumulate, ckpt_path=ckpt_path, enable_model_summary=False)
    return fit(module, strategy, devices, batch_size, steps, data, **options, **kwargs)


def single(optimizer: str, world: int, module: MLP | None = None, **kwargs) -> dict[str, torch.Tensor]:
    """One process on the global batch of `world` ranks."""
    module = compared_mlp(optimizer) if module is None else module
    return run(module, "single", 1, PER_RANK_BATCH * world, **kwargs).strategy.full_state_dict()


def is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# ------------------------------------------------------------------------------------ bodies run on every rank


def body_every_strategy(optimizers: list[str], strategies: list[str], trainer_kwargs: dict | None = None):
    out = {}
    for optimizer in optimizers:
        for name in strategies:
            trainer = run(compared_mlp(optimizer), per_layer(name), dist.get_world_size(), **(trainer_kwargs or {}))
            assert trainer.global_step == STEPS
            out[(optimizer, name)] = trainer.strategy.full_state_dict()
    return out if is_rank_zero() else None


# ------------------------------------------------------------------------------------------------------ tests


def test_the_check_finds_what_the_table_says_of_torchs_optimizers():
    """The table (KNOWN) is what the check finds from each optimizer's own step, for every class in it; and it
    tells pytorch-optimizer's Lion (element-wise) from its Lamb and SOAP and a hand-written LAMB."""
    weight, bias = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))
    for cls, kind in KNOWN.items():
        params = [weight] if cls is torch.optim.Muon else [weight, bias]
        assert probe(cls(params, lr=0.01)) is kind, cls.__name__
    assert probe(Lion([weight, bias])) is StepKind.ELEMENTWISE
    for optimizer in (Lamb([weight, bias]), SOAP([weight, bias]), OwnLamb([weight, bias])):
        assert probe(optimizer) is StepKind.PER_TENSOR, type(optimizer).__name__


def test_a_subclass_of_a_known_optimizer_is_checked_not_assumed():
    class ScaledAdamW(torch.optim.AdamW):  # AdamW's step, then each tensor rescaled by its own norm
        @torch.no_grad()
        def step(self, closure=None):
            super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    p.div_(p.norm().clamp_min(1.0))

    assert step_kind(ScaledAdamW([nn.Parameter(torch.randn(4, 3))])) is StepKind.PER_TENSOR


@pytest.mark.parametrize("world", [2, 3])
def test_whole_tensor_optimizers_match_one_process_under_every_strategy(rank_pool, world):
    """Adafactor (factored second moments, scaled by each tensor's RMS), Muon (orthogonalised matrices), LAMB
    (trust ratio per tensor: a hand-written one and pytorch-optimizer's) step whole tensors that a rank owns;
    Lion, element-wise, keeps stepping pieces. At 3 ranks the shards are uneven."""
    optimizers = ["adafactor", "muon", "own-lamb", "lamb", "lion"]
    strategies = ["ddp", "zero1", "zero2", "fsdp"]
    results = rank_pool(world).run(body_every_strategy, optimizers, strategies)[0]
    initial = new_mlp("adafactor").state_dict()
    for optimizer in optimizers:
        want = single(optimizer, world)
        assert max_relative_difference(want, {k: v for k, v in initial.items() if k in want}) > 1e-2  # it trained
        for name in strategies:
            difference = max_relative_difference(results[(optimizer, name)], want)
            assert difference <= TOLERANCE, (optimizer, name, world, difference)


def body_soap() -> dict | None:
    out = {}
    for name in ("ddp", "zero1", "zero2", "fsdp"):
        trainer = run(new_mlp("soap").double(), per_layer(name), 2, accumulate=1, clip=None)
        out[name] = trainer.strategy.full_state_dict()
    return out if is_rank_zero() else None


def test_soap_steps_whole_tensors_as_ddp_does(rank_pool):
    """SOAP's first eigenbasis is that of one gradient's outer product, which is degenerate: any basis of its
    null space will do, so a difference of 1e-16 in the averaged gradient (the order one process and two ranks
    sum in) turns into 1e-1 in the weights, even in float64 under ddp. Its reference is therefore ddp's step of
    whole replicated tensors on two ranks, whose gradients every strategy averages bit for bit alike (a + b; no
    accumulation, and no clipping, whose norm sharded gradients sum in another order): sharded state must give
    exactly that, where stepping pieces gave 2e-1."""
    results = rank_pool(2).run(body_soap)[0]
    want = results.pop("ddp")
    for name, got in results.items():
        assert max_relative_difference(got, want) <= 1e-12, name


class SplitMLP(MLP):
    """The MLP built in configure_model, its layers split by torch's tensor parallel when the strategy asks: the
    first column-wise (each rank holds rows of its matrix), the second row-wise (columns)."""

    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer, bias=optimizer != "muon")
        self.l1 = self.l2 = None
        self.built_dtype = compared_dtype(optimizer)

    def configure_model(self) -> None:
        torch.manual_seed(0)
        bias = self.optimizer_name != "muon"
        self.l1 = nn.Linear(IN, HIDDEN, bias=bias).to(self.built_dtype)  # drawn as new_mlp draws them
        self.l2 = nn.Linear(HIDDEN, OUT, bias=bias).to(self.built_dtype)
        if self.trainer.strategy.tensor_parallel_size > 1:
            plan = {"l1": ColwiseParallel(), "l2": RowwiseParallel()}
            parallelize_module(self, self.device_mesh["tensor_parallel"], plan)


def body_four_ranks(optimizers: list[str]) -> dict | None:
    """hsdp and zero2 in two groups of two ranks; dp 2 x tp 2 under every strategy."""
    out = {}
    for optimizer in optimizers:
        for name in ("hsdp", "zero2-hybrid"):
            trainer = run(compared_mlp(optimizer), per_layer(name), 4)
            assert trainer.strategy.engine.groups.hybrid
            out[(optimizer, name)] = trainer.strategy.full_state_dict()
        for name, cls in (("ddp", DDPStrategy), ("zero1", ZeroStrategy), ("zero2", ZeroStrategy), ("fsdp", None)):
            if cls is None:
                strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, tensor_parallel_size=2)
            elif cls is ZeroStrategy:
                strategy = ZeroStrategy(stage=int(name[-1]), tensor_parallel_size=2)
            else:
                strategy = DDPStrategy(tensor_parallel_size=2)
            trainer = run(SplitMLP(optimizer), strategy, 4)
            out[(optimizer, f"{name} tp 2")] = trainer.strategy.full_state_dict()
    return out if is_rank_zero() else None


def test_whole_tensor_optimizers_under_hybrid_sharding_and_tensor_parallel(rank_pool):
    """Four ranks: hybrid sharding (two groups of two, each group's owners stepping the same whole tensors), and
    dp 2 x tp 2, where the whole tensor is the unsplit one: Muon orthogonalises the whole (32, 16) matrix, not
    each rank's (16, 16) rows, and Adafactor factors the whole matrix's second moments."""
    results = rank_pool(4).run(body_four_ranks, ["adafactor", "muon"])[0]
    for optimizer in ("adafactor", "muon"):
        hybrid, split = single(optimizer, 4), single(optimizer, 2)
        for (name_optimizer, name), got in results.items():
            if name_optimizer == optimizer:
                want = split if "tp" in name else hybrid
                assert max_relative_difference(got, want) <= TOLERANCE, (optimizer, name)


class MuonAndAdamW(MLP):
    """Muon's usual split: Muon for the matrices, AdamW for the rest; two optimizers, so stepped by hand
    (Lightning's manual optimization)."""

    def __init__(self) -> None:
        super().__init__("muon+adamw")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()
        return loss

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.ndim == 2]
        others = [p for p in self.parameters() if p.ndim != 2]
        return [torch.optim.Muon(matrices, lr=0.05), torch.optim.AdamW(others, lr=0.01)]


def new_muon_and_adamw() -> MuonAndAdamW:
    torch.manual_seed(0)
    return MuonAndAdamW().to(compared_dtype("muon"))


def body_muon_and_adamw_and_bf16() -> dict | None:
    out = {}
    for name in ("ddp", "zero1", "zero2", "fsdp"):
        # as in Lightning, global_step counts every optimizer's steps: two per batch
        trainer = run(new_muon_and_adamw(), per_layer(name), 2, accumulate=1, clip=None, steps=2 * STEPS)
        out[("muon+adamw", name)] = trainer.strategy.full_state_dict()
        trainer = run(new_mlp("adafactor"), per_layer(name), 2, precision="bf16-mixed")
        out[("bf16-mixed", name)] = trainer.strategy.full_state_dict()
    return out if is_rank_zero() else None


def test_muon_with_adamw_by_hand_and_adafactor_in_bf16_mixed(rank_pool):
    """Two optimizers sharing the model's units (one steps whole matrices, the other pieces), stepped by hand;
    and Adafactor under bf16-mixed, beside one process's bf16-mixed run (the same autocast; the sums of the
    gradients' reduction differ, so within bf16's rounding)."""
    results = rank_pool(2).run(body_muon_and_adamw_and_bf16)[0]
    want = single("muon+adamw", 2, new_muon_and_adamw(), accumulate=1, clip=None, steps=2 * STEPS)
    bf16 = single("adafactor", 2, precision="bf16-mixed")
    fp32 = single("adafactor", 2)
    assert max_relative_difference(bf16, fp32) > 1e-4  # bf16 really was used
    for name in ("ddp", "zero1", "zero2", "fsdp"):
        assert max_relative_difference(results[("muon+adamw", name)], want) <= TOLERANCE, name
        assert max_relative_difference(results[("bf16-mixed", name)], bf16) <= 1e-3, name


def body_checkpoint(path: str, saving: str, loading: str) -> dict | None:
    """Train 2 of 3 steps under `saving` and save; or resume under `loading` for the third step."""
    world = dist.get_world_size()
    if saving:
        run(new_mlp("adafactor"), per_layer(saving), world, steps=2).save_checkpoint(path)
        return None
    trainer = run(new_mlp("adafactor"), per_layer(loading), world, ckpt_path=path)
    assert trainer.global_step == STEPS
    state = trainer.strategy.full_state_dict()  # (collective)
    return state if is_rank_zero() else None


def test_a_checkpoint_of_whole_tensor_state_resumes_under_another_strategy_and_world_size(rank_pool, tmp_path):
    """Adafactor's factored state is saved in its own shapes ((32, 1) rows, (1, 16) columns, not pieces) by the
    rank that steps each matrix, and resumes exactly: fsdp on 2 ranks -> one process, -> zero2 on 2 ranks; one
    process -> fsdp on 2 ranks (the global batch stays 4: 2 ranks of 2, 1 of 4)."""
    from torch.distributed.checkpoint import FileSystemReader

    path = str(tmp_path / "fsdp2")
    rank_pool(2).run(body_checkpoint, path, "fsdp", "")
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    assert list(metadata["optim.state.l1.weight.row_var"].size) == [HIDDEN, 1]
    assert list(metadata["optim.state.l1.weight.col_var"].size) == [1, IN]
    want = single("adafactor", 2)
    got = run(new_mlp("adafactor"), "ddp", 1, PER_RANK_BATCH * 2, ckpt_path=path).strategy.full_state_dict()
    assert max_relative_difference(got, want) <= TOLERANCE, "fsdp 2 -> one process"
    got = rank_pool(2).run(body_checkpoint, path, "", "zero2")[0]
    assert max_relative_difference(got, want) <= TOLERANCE, "fsdp 2 -> zero2 2"
    one = str(tmp_path / "one")
    run(new_mlp("adafactor"), "single", 1, PER_RANK_BATCH * 2, steps=2).save_checkpoint(one)
    got = rank_pool(2).run(body_checkpoint, one, "", "fsdp")[0]
    assert max_relative_difference(got, want) <= TOLERANCE, "one process -> fsdp 2"


def lbfgs_plain_torch(world: int) -> dict[str, torch.Tensor]:
    """LBFGS in a plain torch loop on the global batch: the closure zeroes, evaluates and backpropagates."""
    module = new_mlp("lbfgs")
    optimizer = make_optimizer("lbfgs", module.parameters())
    for step, (x, y) in enumerate(DataLoader(dataset(), batch_size=PER_RANK_BATCH * world)):
        if step == STEPS:
            break

        def closure(x=x, y=y):
            optimizer.zero_grad()
            loss = F.cross_entropy(module(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def body_lbfgs() -> dict:
    """ddp runs LBFGS (with a closure, as Lightning); the strategies that shard optimizer state refuse it."""
    trainer = run(new_mlp("lbfgs"), "ddp", 2, accumulate=1, clip=None)
    out = {"ddp": trainer.strategy.full_state_dict(), "refused": {}}
    for name in ("zero1", "zero2", "fsdp"):
        with pytest.raises(ValueError) as refused:
            run(new_mlp("lbfgs"), per_layer(name), 2, accumulate=1, clip=None)
        out["refused"][name] = str(refused.value)
    with pytest.raises(ValueError, match="accumulate_grad_batches=2: LBFGS"):
        run(new_mlp("lbfgs"), "ddp", 2, accumulate=2, clip=None)
    return out


def test_lbfgs_gets_a_closure_and_runs_where_every_rank_holds_everything(rank_pool):
    """LBFGS's step evaluates the loss itself (`optimizer.step(closure)`): the Trainer passes the closure, as
    Lightning does, and its loss is the global batch's, so ddp and one process step as plain torch does. Under
    zero1, zero2 and fsdp each rank holds part of the one vector LBFGS steps: refused before the first step."""
    want = lbfgs_plain_torch(2)
    one = run(new_mlp("lbfgs"), "single", 1, PER_RANK_BATCH * 2, accumulate=1, clip=None).strategy.full_state_dict()
    assert max_relative_difference(one, want) <= TOLERANCE
    results = rank_pool(2).run(body_lbfgs)
    assert max_relative_difference(results[0]["ddp"], want) <= TOLERANCE
    for name, message in results[0]["refused"].items():
        assert "LBFGS steps every parameter at once" in message and "strategy='ddp'" in message, name


def test_bad_optimizer_input_says_what_to_do(tmp_path):
    """Muon given a vector, an optimizer declared element-wise that is not, a declaration that is not a class,
    and two optimizers in automatic optimization: each a clear error naming the way out."""
    with pytest.raises(ValueError, match="Muon steps matrices only.*AdamW"):
        run(MLP("muon", bias=True), "single", 1)
    with pytest.raises(ValueError, match="elementwise_optimizers names OwnLamb, but its step is not element-wise"):
        run(new_mlp("own-lamb"), ZeroStrategy(stage=2, elementwise_optimizers={OwnLamb}), 1)
    with pytest.raises(TypeError, match="elementwise_optimizers takes optimizer classes"):
        FSDPStrategy(elementwise_optimizers={"lion"})

    class TwoInAutomatic(MuonAndAdamW):
        automatic_optimization = True

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = True

    with pytest.raises(ValueError, match="several optimizers need manual optimization"):
        run(TwoInAutomatic(), "single", 1)


def body_optimizer_bytes() -> dict:
    out = {}
    for optimizer in ("adafactor", "muon"):
        for name in ("zero2", "fsdp"):
            trainer = run(new_mlp(optimizer), per_layer(name), 2)
            out[(optimizer, name)] = trainer.strategy.memory_report()["optimizer_state"]
    return out


def test_the_plan_counts_whole_tensor_state_as_the_engine_holds_it(rank_pool):
    """Each rank keeps the state of the whole matrices it owns: Muon one buffer of each, Adafactor a row and a
    column of each matrix (and a vector's variance); the plan lays the owners out as the engine does and counts
    the same bytes on every rank, and the step's whole tensors beside them."""
    from strategies.plan.model_bytes import model_state_bytes
    from strategies.sharding import FULL_SHARD, ZERO2

    by_rank = rank_pool(2).run(body_optimizer_bytes)
    for optimizer in ("adafactor", "muon"):
        for name, spec in (("zero2", ZERO2), ("fsdp", FULL_SHARD)):
            policy = {nn.Linear} if name == "fsdp" else None
            for rank in (0, 1):
                planned = model_state_bytes(new_mlp(optimizer), spec, 2, rank, policy, optimizer=optimizer)
                assert planned.optimizer == by_rank[rank][(optimizer, name)], (optimizer, name, rank)
    # Adafactor factors (32, 16): 32 + 16 elements, not 512; Muon keeps all 512 of its momentum
    rows_and_columns = model_state_bytes(new_mlp("adafactor"), FULL_SHARD, 1, 0, optimizer="adafactor")
    assert rows_and_columns.optimizer == 4 * ((HIDDEN + IN) + HIDDEN + (OUT + HIDDEN) + OUT)
    whole = model_state_bytes(new_mlp("muon"), FULL_SHARD, 2, 0, {nn.Linear}, optimizer="muon")
    assert whole.optimizer_step == 4 * 4 * HIDDEN * IN  # rank 0 steps the (32, 16) matrix whole


def plain_loop(strategy=None) -> dict[str, torch.Tensor]:
    """A plain torch loop with torch's Adafactor and clip_grad_norm_, 4 samples a step: in one process, or under
    `strategy` (setup_module / setup_optimizer, Fabric's names) each rank on its share of them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    optimizer = torch.optim.Adafactor(model.parameters(), lr=0.05)
    rank, world = 0, 1
    if strategy is not None:
        model, optimizer = strategy.setup_module(model), None
        optimizer = strategy.setup_optimizer(torch.optim.Adafactor(model.parameters(), lr=0.05))
        rank, world = dist.get_rank(), dist.get_world_size()
    x, y = dataset().tensors
    for step in range(STEPS):
        rows = torch.arange(step * 4, (step + 1) * 4)[rank::world]
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    if strategy is None:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = optimizer.state_dict()  # the habit: this rank's state, of the whole matrices it owns
    optimizer.load_state_dict(state)
    shapes = {tuple(v.shape) for entries in state["state"].values() for k, v in entries.items() if k != "step"}
    assert shapes and shapes <= {(HIDDEN, 1), (1, IN), (OUT, 1), (1, HIDDEN), (HIDDEN,), (OUT,)}, shapes
    return strategy.full_state_dict()


def body_plain_loop() -> dict[str, torch.Tensor]:
    return plain_loop(FSDPStrategy(auto_wrap_policy={nn.Linear}))


def test_a_plain_torch_loop_with_adafactor_and_clip_grad_norm(rank_pool):
    """The habits of a plain torch user under fsdp: torch's clip_grad_norm_ on the model's parameters, and the
    optimizer's own state_dict() saved and loaded on the same rank (Adafactor's factors in their shapes)."""
    want = plain_loop()
    got = rank_pool(2).run(body_plain_loop)[0]
    assert max_relative_difference(got, want) <= TOLERANCE
