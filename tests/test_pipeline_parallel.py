"""Pipeline parallel (docs/strategies.md, "Deep models"): the ranks of a pipeline group hold the model's stages,
torch's schedules run each batch's micro-batches through them, and K steps give one process's weights on the same
global batch, under every schedule and strategy, with tensor parallel, and across checkpoints of other layouts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from examples.llama import LLAMA_PRESETS, Block, Llama
from strategies import DDPStrategy, FSDPStrategy, ZeroStrategy
from tests.test_parity import max_relative_difference
from trainer import Trainer, TrainModule
from trainer.checkpoint import consolidate, export_safetensors, load_full_state_dict

SEQ, VOCAB, BATCH, STEPS = 16, 64, 4, 3
TOLERANCE = 1e-4  # AdamW, as tests/test_parity.py
CONFIG = dataclasses.replace(LLAMA_PRESETS["tiny"], vocab_size=VOCAB, max_seq_len=SEQ, n_layers=4)
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


class PipelinedLlama(TrainModule):
    """The Llama example as a pipeline-ready module: its forward skips the modules a stage does not hold, and
    pipeline_loss gives the last stage's loss (training_step is what one process runs)."""

    def __init__(self, tensor_parallel: bool = False) -> None:
        super().__init__()
        self.tensor_parallel = tensor_parallel
        torch.manual_seed(0)
        self.model = None if tensor_parallel else Llama(CONFIG)

    def configure_model(self) -> None:
        if self.tensor_parallel:
            from examples.llama import tensor_parallel

            torch.manual_seed(0)
            self.model = tensor_parallel(Llama(CONFIG), self.device_mesh["tensor_parallel"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.log("train/loss", loss)
        return loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-6)


def tokens(samples: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(
        torch.randint(0, VOCAB, (samples, SEQ), generator=g), torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    )


def strategy_of(name: str, pp: int, schedule: str = "1F1B", tp: int = 1, **options):
    options = dict(pipeline_parallel_size=pp, pipeline_schedule=schedule, tensor_parallel_size=tp, **options)
    if name == "ddp":
        return DDPStrategy(**options)
    if name in ("zero1", "zero2"):
        return ZeroStrategy(stage=int(name[-1]), **options)
    return FSDPStrategy(auto_wrap_policy={Block}, **options)


def fit(module, strategy, devices: int, batch_size: int = BATCH, steps: int = STEPS, **kwargs) -> Trainer:
    """STEPS steps of 2 accumulated batches, clipped at 0.5, writing nothing."""
    options = dict(max_steps=steps, max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=0.5, logger=False)
    options.update(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = Trainer(strategy=strategy, devices=devices, **{**options, **kwargs})
    trainer.fit(module, DataLoader(tokens(), batch_size=batch_size), ckpt_path=ckpt_path)
    return trainer


def one_process(data_parallel: int = 1, **kwargs) -> Trainer:
    return fit(PipelinedLlama(), "single", 1, BATCH * data_parallel, **kwargs)


def is_rank_zero() -> bool:
    return dist.get_rank() == 0


# ------------------------------------------------------------------------------------ bodies run on every rank


def body_schedules(names: list[str], schedules: list[str], pp: int, tp: int = 1) -> dict | None:
    out = {}
    for name in names:
        for schedule in schedules:
            trainer = fit(PipelinedLlama(tp > 1), strategy_of(name, pp, schedule, tp), dist.get_world_size())
            assert trainer.strategy.device_mesh["pipeline_parallel"].size() == pp
            out[(name, schedule)] = trainer.strategy.full_state_dict()
    return out if is_rank_zero() else None


# ------------------------------------------------------------------------------------------------------ tests


def test_llama_at_pipeline_parallel_2_matches_one_process_under_every_schedule(rank_pool):
    """Two ranks, four micro-batches a batch: GPipe and 1F1B with one stage per rank, the looped and V-shaped
    schedules with two (four blocks, one each); accumulation and clipping (the norm over every stage)."""
    results = rank_pool(2).run(body_schedules, ["ddp"], SCHEDULES, 2)[0]
    want = one_process().strategy.full_state_dict()
    for key, got in results.items():
        assert max_relative_difference(got, want) <= TOLERANCE, key


def test_pipeline_2_x_data_parallel_2_under_every_strategy(rank_pool):
    """Four ranks: each stage spread over two data-parallel ranks by the strategy (fsdp shards a stage's blocks
    over its two ranks)."""
    results = rank_pool(4).run(body_schedules, ["ddp", "zero1", "zero2", "fsdp"], ["1F1B"], 2)[0]
    want = one_process(data_parallel=2).strategy.full_state_dict()
    for key, got in results.items():
        assert max_relative_difference(got, want) <= TOLERANCE, key


def test_pipeline_2_x_tensor_parallel_2(rank_pool):
    """Each stage split by the Llama example's tensor-parallel plan over two ranks, its sequence-parallel
    activations going from stage to stage as local pieces."""
    results = rank_pool(4).run(body_schedules, ["ddp", "fsdp"], ["1F1B"], 2, 2)[0]
    want = one_process().strategy.full_state_dict()
    for key, got in results.items():
        assert max_relative_difference(got, want) <= TOLERANCE, key


def test_pipeline_2_x_data_parallel_2_x_tensor_parallel_2_on_eight_ranks(rank_pool):
    """Every dimension at once: two stages, each over two data-parallel ranks sharding by fsdp,
    each of those over two tensor-parallel ranks splitting its blocks."""
    results = rank_pool(8).run(body_schedules, ["fsdp"], ["1F1B"], 2, 2)[0]
    want = one_process(data_parallel=2).strategy.full_state_dict()
    for key, got in results.items():
        assert max_relative_difference(got, want) <= TOLERANCE, key


def gpt(tied: bool):
    """The GPT example on the test's tokens; its head its own matrix unless `tied`. In float64: its AdamW's eps of
    1e-8 turns float32's rounding of near-zero gradients (summed in another order than one process) into 1e-4."""
    from examples.gpt import GPT, GPTConfig, GPTModule

    config = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32, tie_weights=tied)
    module = GPTModule(config, warmup_steps=1, max_steps=STEPS)
    torch.manual_seed(0)
    module.model = GPT(config).double()
    return module


def body_gpt() -> tuple[dict | None, str]:
    state = fit(gpt(tied=False), strategy_of("ddp", 2), 2).strategy.full_state_dict()
    with pytest.raises(ValueError) as tied:
        fit(gpt(tied=True), strategy_of("ddp", 2), 2, steps=1)
    return (state if is_rank_zero() else None), str(tied.value)


def test_the_gpt_example_untied_is_pipeline_ready(rank_pool):
    """examples/gpt.py with GPTConfig(tie_weights=False) at pp 2: one process's weights (its learning-rate schedule
    too); tied, its head and embedding are one parameter that two stages cannot both hold, and the error says so."""
    got, tied = rank_pool(2).run(body_gpt)[0]
    want = fit(gpt(tied=False), "single", 1).strategy.full_state_dict()
    assert max_relative_difference(got, want) <= TOLERANCE
    assert "are one tied parameter; untie them" in tied


def body_logged_and_evaluated() -> dict | None:
    trainer = fit(PipelinedLlama(), strategy_of("fsdp", 2, "Interleaved1F1B"), 2)
    logged = float(trainer.callback_metrics["train/loss"])
    validated = trainer.validate(trainer.module, DataLoader(tokens(8), batch_size=BATCH))[0]["val/loss"]
    predicted = trainer.predict(trainer.module, DataLoader(tokens(8), batch_size=BATCH))
    return {"logged": logged, "val": validated, "predicted": predicted} if is_rank_zero() else None


def test_logged_loss_validation_and_predict_run_through_the_pipeline(rank_pool):
    """Rank 0 holds the first stage: what pipeline_loss logged on the last one reaches it as one process's
    mean over the batch; validation_step and predict_step run on the pipeline's output."""
    got = rank_pool(2).run(body_logged_and_evaluated)[0]
    trainer = one_process()
    assert got["logged"] == pytest.approx(float(trainer.callback_metrics["train/loss"]), rel=1e-5)
    validated = trainer.validate(trainer.module, DataLoader(tokens(8), batch_size=BATCH))[0]["val/loss"]
    assert got["val"] == pytest.approx(validated, rel=1e-5)
    predicted = trainer.predict(trainer.module, DataLoader(tokens(8), batch_size=BATCH))
    assert torch.equal(torch.cat(got["predicted"]), torch.cat(predicted))


def body_checkpoint(path: str, pp: int, saving: bool, name: str = "fsdp") -> dict | None:
    """Train 2 of 3 steps at pipeline size `pp` under `name` and save, or resume for the third (the global batch
    stays BATCH samples)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    strategy = strategy_of(name, pp) if world > 1 else "single"
    batch_size = BATCH * pp // world
    if saving:
        fit(PipelinedLlama(), strategy, world, batch_size, steps=2).save_checkpoint(path)
        return None
    trainer = fit(PipelinedLlama(), strategy, world, batch_size, ckpt_path=path)
    state = trainer.strategy.full_state_dict()
    return state if world == 1 or is_rank_zero() else None


def test_a_checkpoint_resumes_under_another_pipeline_layout(rank_pool, tmp_path):
    """Checkpoints are keyed by the model's own names (stages keep them; the optimizer's state too): saved at
    pp 2, resumed by one process, by plain fsdp on 2 ranks, at pp 4 and under zero2 at pp 2; saved by one process,
    resumed at pp 2; load_full_state_dict, the one-file checkpoint and the safetensors export give the whole model
    from the pp 2 checkpoint."""
    want = one_process().strategy.full_state_dict()
    pp2 = str(tmp_path / "pp2")
    rank_pool(2).run(body_checkpoint, pp2, 2, True)
    whole = load_full_state_dict(pp2)
    assert sorted(whole) == sorted(PipelinedLlama().state_dict())
    consolidate(pp2, str(tmp_path / "one.pt"))  # the one-file checkpoint and the safetensors export: every stage
    export_safetensors(pp2, str(tmp_path / "exported"))
    exported = {}
    for file in sorted((tmp_path / "exported").glob("*.safetensors")):
        exported.update(load_file(file))
    for got in (torch.load(tmp_path / "one.pt", weights_only=True), exported):
        assert sorted(got) == sorted(whole) and all(torch.equal(got[k], whole[k]) for k in whole)
    results = {
        "one process": body_checkpoint(pp2, 1, False),
        "fsdp 2": rank_pool(2).run(body_checkpoint, pp2, 1, False)[0],
        "pp 4": rank_pool(4).run(body_checkpoint, pp2, 4, False)[0],
        "zero2 pp 2": rank_pool(2).run(body_checkpoint, pp2, 2, False, "zero2")[0],
    }
    single = str(tmp_path / "single")
    body_checkpoint(single, 1, True)
    results["from one process"] = rank_pool(2).run(body_checkpoint, single, 2, False)[0]
    for key, got in results.items():
        assert max_relative_difference(got, want) <= TOLERANCE, key


def body_checkpointing_and_bf16() -> dict | None:
    out = {}
    for precision in ("32", "bf16-mixed"):
        strategy = strategy_of("fsdp", 2, "Interleaved1F1B", activation_checkpointing={Block})
        out[precision] = fit(PipelinedLlama(), strategy, 2, precision=precision).strategy.full_state_dict()
    return out if is_rank_zero() else None


def test_activation_checkpointing_and_bf16_mixed_under_a_pipeline(rank_pool):
    """Recomputed blocks inside the schedule's backward; bf16-mixed autocasts every stage's forward, and stays as
    close to fp32 as one process's bf16-mixed run."""
    results = rank_pool(2).run(body_checkpointing_and_bf16)[0]
    fp32 = one_process().strategy.full_state_dict()
    assert max_relative_difference(results["32"], fp32) <= TOLERANCE
    bf16 = one_process(precision="bf16-mixed").strategy.full_state_dict()
    rounding = max_relative_difference(bf16, fp32)
    assert rounding > 1e-3  # bf16 really was used
    assert max_relative_difference(results["bf16-mixed"], bf16) <= rounding


class NoLoss(PipelinedLlama):
    pipeline_loss = None


class CallsEverything(PipelinedLlama):
    def forward(self, tokens):
        return self.model.output(self.model.norm(self.model.tok_embeddings(tokens)))


def body_bad_input(case: str) -> str:
    options = {
        "split name": dict(pipeline_split=[["model.tok_embeddings", "model.layers.0"], ["model.layer.1"]]),
        "split left out": dict(pipeline_split=[["model.tok_embeddings", "model.layers.0"], ["model.layers.1"]]),
        "microbatches": dict(pipeline_microbatches=1),
        "indivisible": dict(pipeline_microbatches=3),
    }.get(case, {})
    module = {"no loss": NoLoss, "calls everything": CallsEverything}.get(case, PipelinedLlama)()
    with pytest.raises((ValueError, TypeError)) as error:
        fit(module, strategy_of("ddp", 2, **options), 2, steps=1)
    return str(error.value)


def test_bad_pipeline_input_names_the_argument(rank_pool):
    with pytest.raises(ValueError, match="pipeline_parallel_size=0; choose a positive int"):
        DDPStrategy(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_schedule='1f1b'; choose one of"):
        FSDPStrategy(pipeline_parallel_size=2, pipeline_schedule="1f1b")
    with pytest.raises(ValueError, match="pipeline_microbatches=0; choose a positive int"):
        ZeroStrategy(pipeline_microbatches=0)
    cases = ["size", "split name", "split left out", "microbatches", "indivisible", "no loss"]
    messages = {case: rank_pool(2).run(body_bad_input_or_size, case)[0] for case in cases}
    assert "pipeline_parallel_size=3 (3) does not divide the 2 ranks" in messages["size"]
    assert "stage 1 names 'model.layer.1', which is not a module of the model" in messages["split name"]
    assert "no stage holds ['model.layers.2" in messages["split left out"]
    assert (
        "pipeline_microbatches=1: pipeline_schedule='1F1B' over 2 stages on 2 ranks needs at least 2"
        in (messages["microbatches"])
    )
    assert "a batch of 4 samples does not divide into 3 micro-batches" in messages["indivisible"]
    assert "has no pipeline_loss(output, target)" in messages["no loss"]


def test_a_forward_that_calls_a_module_its_stage_lacks_says_so():
    """Two stages on one rank (no other rank to wait for): the first stage's view runs a forward that calls the
    head, which only the second stage holds."""
    from strategies.pipeline_parallel import PipelineParallel

    pipeline = PipelineParallel(1, 0, "Interleaved1F1B", 2, None, None, torch.device("cpu"))
    module = CallsEverything()
    pipeline.cut(module)
    assert pipeline.split[0][0] == "model.tok_embeddings" and pipeline.split[1][-1] == "model.output"
    assert pipeline.views[0].model.output is None and pipeline.views[1].model.tok_embeddings is None
    assert sorted(module.state_dict()) == sorted(CallsEverything().state_dict())  # the rank holds both stages
    with pytest.raises(TypeError, match="called a module that this rank's stage does not hold"):
        pipeline.forward(torch.zeros(2, SEQ, dtype=torch.long))


def body_bad_input_or_size(case: str) -> str:
    if case != "size":
        return body_bad_input(case)
    with pytest.raises(ValueError) as error:
        fit(PipelinedLlama(), strategy_of("ddp", 3), 2, steps=1)
    return str(error.value)


def body_memory(name: str) -> dict:
    trainer = fit(PipelinedLlama(), strategy_of(name, 2), dist.get_world_size(), steps=1)
    report = trainer.strategy.memory_report()
    return {kind: report[kind] for kind in ("parameters", "gradients", "optimizer_state")}


def test_the_plan_counts_the_largest_stage_as_the_engine_holds_it(rank_pool):
    """plan_memory at pipeline_parallel=2: the model state of the pipeline rank with the most parameters, sharded
    over its data-parallel ranks, equals the largest the engine reports on any rank (pp 2 x dp 2); fsdp's units
    stay gathered under a pipeline, and the activations are those of the micro-batches 1F1B keeps."""
    from strategies.plan import plan_memory

    with torch.device("meta"):
        model = PipelinedLlama()
    plan = plan_memory(model, world_size=4, batch_size=BATCH, seq_len=SEQ, wrap_policy={Block}, pipeline_parallel=2)
    for name in ("ddp", "zero2", "fsdp"):
        reports = rank_pool(4).run(body_memory, name)
        row = plan.strategies[name]
        assert row.parameters == max(r["parameters"] for r in reports), name
        assert row.optimizer == max(r["optimizer_state"] for r in reports), name
    whole = plan_memory(model, world_size=4, batch_size=BATCH, seq_len=SEQ, wrap_policy={Block})
    assert plan.strategies["fsdp"].units_in_flight > whole.strategies["fsdp"].units_in_flight / 2
    assert plan.activations < whole.activations
    with pytest.raises(ValueError, match="pipeline_microbatches=3"):
        plan_memory(model, world_size=4, batch_size=BATCH, seq_len=SEQ, pipeline_parallel=2, pipeline_microbatches=3)


def body_auto_pipeline() -> tuple[int, str, int, int]:
    """strategy="auto" with a budget that the model fits only when cut in two stages; and Trainer.plan of a strategy
    with a pipeline, which plans its stages."""
    loader = DataLoader(tokens(8), batch_size=BATCH)
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    whole = Trainer(strategy="auto", devices=2, **quiet).plan(PipelinedLlama(), train_dataloaders=loader)
    staged = Trainer(strategy=DDPStrategy(pipeline_parallel_size=2), devices=2, **quiet).plan(
        PipelinedLlama(), train_dataloaders=loader
    )
    best = min(r.total for r in staged.strategies.values())
    budget = (min(r.total for r in whole.strategies.values()) + best) // 2
    trainer = Trainer(strategy="auto", devices=2, max_steps=1, max_memory_per_rank=budget, **quiet)
    trainer.fit(PipelinedLlama(), loader)
    return trainer.strategy.pipeline_parallel_size, trainer.strategy.name, budget, best


def test_auto_strategy_cuts_a_model_that_fits_no_rank_whole_into_stages(rank_pool):
    """When no strategy fits a rank, with or without tensor parallel, strategy="auto" tries pipeline sizes for a
    pipeline-ready module: here 2 stages, under ddp (the least communication that then fits)."""
    (pp, name, budget, best), _ = rank_pool(2).run(body_auto_pipeline)
    assert (pp, name) == (2, "ddp"), (pp, name, budget)
    assert best < budget
