"""Context parallel (docs/strategies.md, "Long sequences"): the ranks of a context-parallel group read the same
samples, each trains on its part of every sequence, and attention is exact over the whole sequence ("ulysses": an
all-to-all trades the sequence for heads around F.scaled_dot_product_attention). K steps give one process's
weights on the global batch, the examples' GPT and Llama as they are written.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from examples.gpt import GPT, GPTConfig
from examples.gpt import Block as GPTBlock
from examples.llama import LLAMA_PRESETS, Llama
from examples.llama import Block as LlamaBlock
from strategies import DDPStrategy, FSDPStrategy, ZeroStrategy
from tests.test_parity import max_relative_difference
from trainer import Trainer, TrainModule

SEQ, VOCAB, PER_RANK_BATCH, STEPS = 16, 64, 2, 3
TOLERANCE = 1e-4  # AdamW, as tests/test_parity.py: its update turns sums in another order into 1e-5 and more
GPT_CONFIG = GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True)
LLAMA_CONFIG = dataclasses.replace(LLAMA_PRESETS["tiny"], vocab_size=VOCAB, max_seq_len=SEQ)


class LM(TrainModule):
    """A language model on (inputs, targets) batches, its loss the mean over the counted targets."""

    def __init__(self, kind: str = "gpt") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.model = GPT(GPT_CONFIG) if kind == "gpt" else Llama(LLAMA_CONFIG)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())  # (ignore_index -100)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self.model(x).flatten(0, 1), y.flatten()), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-6)


def tokens(samples: int = 24, ignored: bool = False) -> TensorDataset:
    """Random token windows; with `ignored`, targets -100 in uneven runs (more in the later half of the
    sequences, where the last context-parallel rank's part is)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    if ignored:
        for i in range(samples):
            y[i, SEQ - 1 - i % 7 :] = -100
            y[i, i % 3] = -100
    return TensorDataset(x, y)


def block_of(kind: str) -> type:
    return GPTBlock if kind == "gpt" else LlamaBlock


def strategy_of(name: str, kind: str, cp: int, tp: int = 1):
    options = dict(context_parallel_size=cp, tensor_parallel_size=tp)
    if name == "ddp":
        return DDPStrategy(**options)
    if name in ("zero1", "zero2"):
        return ZeroStrategy(stage=int(name[-1]), **options)
    if name == "hsdp":
        return FSDPStrategy(auto_wrap_policy={block_of(kind)}, hybrid_shard=2, **options)
    return FSDPStrategy(auto_wrap_policy={block_of(kind)}, **options)


def quiet_trainer(strategy, devices: int, **kwargs) -> Trainer:
    """A Trainer of `STEPS` steps of 2 accumulated batches, clipped at 0.5, that writes nothing."""
    options = dict(max_steps=STEPS, max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=0.5, logger=False)
    options.update(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return Trainer(strategy=strategy, devices=devices, **{**options, **kwargs})


def fit(
    module,
    strategy,
    devices: int,
    batch_size: int,
    ignored: bool = False,
    steps: int = STEPS,
    ckpt_path=None,
    data: TensorDataset | None = None,
    **kwargs,
) -> Trainer:
    trainer = quiet_trainer(strategy, devices, max_steps=steps, **kwargs)
    data = tokens(ignored=ignored) if data is None else data
    trainer.fit(module, DataLoader(data, batch_size=batch_size), ckpt_path=ckpt_path)
    return trainer


def one_process(kind: str, data_parallel: int, ignored: bool = False) -> dict[str, torch.Tensor]:
    trainer = fit(LM(kind), "single", 1, PER_RANK_BATCH * data_parallel, ignored)
    return trainer.strategy.full_state_dict()


def is_rank_zero() -> bool:
    return dist.get_rank() == 0


# ------------------------------------------------------------------------------------ bodies run on every rank


def body_fit(kinds: list[str], names: list[str], cp: int, tp: int = 1, ignored: bool = False) -> dict | None:
    out = {}
    for kind in kinds:
        for name in names:
            trainer = fit(LM(kind), strategy_of(name, kind, cp, tp), dist.get_world_size(), PER_RANK_BATCH, ignored)
            assert trainer.strategy.device_mesh["context_parallel"].size() == cp
            state = trainer.strategy.full_state_dict()
            out[(kind, name)] = state
    return out if is_rank_zero() else None


# ------------------------------------------------------------------------------------------------------ tests


def test_gpt_and_llama_at_context_parallel_2_match_one_process(rank_pool):
    """Two ranks split each sequence in two: one data-parallel rank, so one process on the same batch; with
    accumulation and clipping; every strategy."""
    results = rank_pool(2).run(body_fit, ["gpt", "llama"], ["ddp", "zero1", "zero2", "fsdp"], 2)[0]
    for kind in ("gpt", "llama"):
        want = one_process(kind, 1)
        for name in ("ddp", "zero1", "zero2", "fsdp"):
            difference = max_relative_difference(results[(kind, name)], want)
            assert difference <= TOLERANCE, (kind, name, difference)


def test_data_parallel_2_x_context_parallel_2_under_every_strategy(rank_pool):
    """Four ranks: two data-parallel ranks, each sequence split over two; hsdp shards within each data-parallel
    rank's context-parallel pair and replicates across the pairs."""
    names = ["ddp", "zero1", "zero2", "fsdp", "hsdp"]
    results = rank_pool(4).run(body_fit, ["gpt", "llama"], names, 2)[0]
    for kind in ("gpt", "llama"):
        want = one_process(kind, 2)
        for name in names:
            difference = max_relative_difference(results[(kind, name)], want)
            assert difference <= TOLERANCE, (kind, name, difference)


class SplitLlama(LM):
    """The Llama example split by its tensor-parallel plan in configure_model."""

    def __init__(self) -> None:
        super().__init__("llama")
        self.model = None

    def configure_model(self) -> None:
        from examples.llama import tensor_parallel

        torch.manual_seed(0)
        self.model = tensor_parallel(Llama(LLAMA_CONFIG), self.device_mesh["tensor_parallel"])


def body_context_and_tensor_parallel() -> dict | None:
    out = {}
    for name in ("ddp", "fsdp"):
        trainer = fit(SplitLlama(), strategy_of(name, "llama", 2, 2), 4, PER_RANK_BATCH)
        out[name] = trainer.strategy.full_state_dict()
    return out if is_rank_zero() else None


def test_context_parallel_2_x_tensor_parallel_2(rank_pool):
    """The Llama example's tensor-parallel plan (sequence-parallel norms, column- and row-wise projections) on
    each half of the sequence: 2 heads and 1 key/value head per tensor-parallel rank, the key/value heads
    repeated for the all-to-all."""
    results = rank_pool(4).run(body_context_and_tensor_parallel)[0]
    want = one_process("llama", 1)
    for name, got in results.items():
        assert max_relative_difference(got, want) <= TOLERANCE, name


def body_ignored_tokens_and_logged_values() -> dict | None:
    trainer = fit(LM("gpt"), strategy_of("fsdp", "gpt", 2), 2, PER_RANK_BATCH, ignored=True)
    logged = float(trainer.callback_metrics["train/loss"])
    state = trainer.strategy.full_state_dict()
    validated = trainer.validate(trainer.module, DataLoader(tokens(8, ignored=True), batch_size=PER_RANK_BATCH))
    return {"state": state, "logged": logged, "val": validated[0]["val/loss"]} if is_rank_zero() else None


def test_uneven_ignored_tokens_weigh_the_loss_and_logged_values_count_each_token_once(rank_pool):
    """Targets -100 spread unevenly (the second half of each sequence has more): each rank's loss is the mean
    over its own counted tokens, weighed by its share of them, so the step is one process's mean over every counted
    token; the logged training loss and the validation loss are one process's too."""
    got = rank_pool(2).run(body_ignored_tokens_and_logged_values)[0]
    trainer = fit(LM("gpt"), "single", 1, PER_RANK_BATCH, ignored=True)
    want = trainer.strategy.full_state_dict()
    assert max_relative_difference(got["state"], want) <= TOLERANCE
    assert got["logged"] == pytest.approx(float(trainer.callback_metrics["train/loss"]), rel=1e-5)
    validated = trainer.validate(trainer.module, DataLoader(tokens(8, ignored=True), batch_size=PER_RANK_BATCH))
    assert got["val"] == pytest.approx(validated[0]["val/loss"], rel=1e-5)


class Predicting(LM):
    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self.model(x)


def body_checkpoint(path: str, cp: int, saving: bool) -> dict | None:
    """Under fsdp at context parallel `cp` on every rank, one sequence of the global batch per micro-batch: train 2
    of 3 steps and save, or resume for the third step and predict (whole sequences, every sample once)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    strategy = strategy_of("fsdp", "llama", cp) if world > 1 else "single"
    batch_size = PER_RANK_BATCH * cp // world  # the global batch stays 2 sequences
    if saving:
        fit(Predicting("llama"), strategy, world, batch_size, steps=2).save_checkpoint(path)
        return None
    trainer = fit(Predicting("llama"), strategy, world, batch_size, ckpt_path=path)
    state = trainer.strategy.full_state_dict()
    predictions = trainer.predict(trainer.module, DataLoader(tokens(8), batch_size=2 * cp // world))
    return {"state": state, "predictions": torch.cat(predictions)} if not world > 1 or is_rank_zero() else None


def test_a_checkpoint_resumes_at_another_context_parallel_size(rank_pool, tmp_path):
    """The sequence split is not part of the model state: saved at cp 2, resumed at cp 1 (one process) and at cp 4;
    saved at cp 1, resumed at cp 2; each ends with one process's weights and predicts its logits (whole
    sequences, predict_step running under context parallel)."""
    want = one_process("llama", 1)
    reference = body_checkpoint(str(tmp_path / "cp1"), 1, saving=True) or body_checkpoint(
        str(tmp_path / "cp1"), 1, saving=False
    )
    assert max_relative_difference(reference["state"], want) <= TOLERANCE
    assert reference["predictions"].shape == (8, SEQ, VOCAB)
    cp2 = str(tmp_path / "cp2")
    rank_pool(2).run(body_checkpoint, cp2, 2, True)
    for got in (
        body_checkpoint(cp2, 1, saving=False),
        rank_pool(4).run(body_checkpoint, cp2, 4, False)[0],
        rank_pool(2).run(body_checkpoint, str(tmp_path / "cp1"), 2, False)[0],
    ):
        assert max_relative_difference(got["state"], want) <= TOLERANCE
        assert torch.allclose(got["predictions"], reference["predictions"], rtol=1e-3, atol=1e-4)


def body_checkpointing_and_bf16() -> dict | None:
    out = {}
    for precision in ("32", "bf16-mixed"):
        strategy = FSDPStrategy(
            auto_wrap_policy={LlamaBlock}, activation_checkpointing={LlamaBlock}, context_parallel_size=2
        )
        trainer = fit(LM("llama"), strategy, 2, PER_RANK_BATCH, precision=precision)
        out[precision] = trainer.strategy.full_state_dict()
    return out if is_rank_zero() else None


def test_activation_checkpointing_and_bf16_mixed_under_context_parallel(rank_pool):
    """Recomputed blocks redo their all-to-alls in backward (the attention of the forward is on then too); under
    bf16-mixed the all-to-alls carry bf16."""
    results = rank_pool(2).run(body_checkpointing_and_bf16)[0]
    fp32 = one_process("llama", 1)
    assert max_relative_difference(results["32"], fp32) <= TOLERANCE
    bf16 = fit(LM("llama"), "single", 1, PER_RANK_BATCH, precision="bf16-mixed").strategy.full_state_dict()
    assert max_relative_difference(bf16, fp32) > 1e-3  # bf16 really was used
    # AdamW turns bf16's rounding into differences of 1e-1 on this tiny model's smallest weights (one process's
    # bf16-mixed run against its fp32 run): context parallel's stays as close to fp32, and closer to bf16's run
    rounding = max_relative_difference(bf16, fp32)
    assert max_relative_difference(results["bf16-mixed"], fp32) <= 1.5 * rounding
    assert max_relative_difference(results["bf16-mixed"], bf16) <= rounding


def body_bad_input(case: str) -> str:
    with pytest.raises(ValueError) as error:
        if case == "sequence":
            fit(LM("gpt"), DDPStrategy(context_parallel_size=2), 2, PER_RANK_BATCH, data=uneven_tokens())
        elif case == "heads":
            config = dataclasses.replace(GPT_CONFIG, n_head=1, n_embd=8)

            class OneHead(LM):
                def __init__(self):
                    super().__init__("gpt")
                    torch.manual_seed(0)
                    self.model = GPT(config)

            fit(OneHead(), DDPStrategy(context_parallel_size=2), 2, PER_RANK_BATCH)
        elif case == "ring":
            fit(LM("gpt"), DDPStrategy(context_parallel_size=2, context_parallel_method="ring"), 2, PER_RANK_BATCH)
        elif case == "no sequence":
            fit(LM("gpt"), DDPStrategy(context_parallel_size=2), 2, PER_RANK_BATCH, data=flat_tokens())
    return str(error.value)


def uneven_tokens() -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (8, SEQ - 1)), torch.randint(0, VOCAB, (8, SEQ - 1)))


def flat_tokens() -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (8,)), torch.randint(0, VOCAB, (8,)))


def test_bad_context_parallel_input_names_the_argument(rank_pool):
    assert "context_parallel_size=3 (3) does not divide the 2 ranks" in rank_pool(2).run(body_size_error)[0]
    with pytest.raises(ValueError, match="context_parallel_size=0; choose a positive int"):
        DDPStrategy(context_parallel_size=0)
    with pytest.raises(ValueError, match="context_parallel_method='rings'; choose one of"):
        FSDPStrategy(context_parallel_size=2, context_parallel_method="rings")
    messages = {
        case: rank_pool(2).run(body_bad_input, case)[0] for case in ("sequence", "heads", "ring", "no sequence")
    }
    assert "have 15 tokens, which do not split into 2 equal parts" in messages["sequence"]
    assert "attention has 1 heads on this rank, which do not split over 2 ranks" in messages["heads"]
    assert "on cpu use context_parallel_method='ulysses'" in messages["ring"]
    assert "no tensor in the batch has a sequence dimension" in messages["no sequence"]


def body_size_error() -> str:
    with pytest.raises(ValueError) as error:
        fit(LM("gpt"), DDPStrategy(context_parallel_size=3), 2, PER_RANK_BATCH)
    return str(error.value)


class HFLlama(TrainModule):
    """A HuggingFace Llama as it comes (attn_implementation="sdpa"), on dict batches with position_ids."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-6)


def hf_batches(batch_size: int) -> DataLoader:
    """The same token windows as dicts, the labels already shifted (HuggingFace's own shift would cut across
    the parts of a sequence), with position_ids."""
    x, y = tokens().tensors
    rows = [{"input_ids": a, "labels": b, "position_ids": torch.arange(SEQ)} for a, b in zip(x, y)]
    return DataLoader(rows, batch_size=batch_size)


def fit_hf(strategy, devices: int, batch_size: int) -> dict[str, torch.Tensor]:
    trainer = quiet_trainer(strategy, devices)
    trainer.fit(HFLlama(), hf_batches(batch_size))
    return trainer.strategy.full_state_dict()


def body_hf() -> dict | None:
    state = fit_hf(FSDPStrategy(context_parallel_size=2), 2, PER_RANK_BATCH)
    return state if is_rank_zero() else None


def test_a_huggingface_llama_at_context_parallel_2(rank_pool):
    """transformers' LlamaForCausalLM with its SDPA attention, the rotary positions from the batch's position_ids
    (split with the sequence), under fsdp at cp 2: one process's weights."""
    want = fit_hf("single", 1, PER_RANK_BATCH)
    got = rank_pool(2).run(body_hf)[0]
    assert max_relative_difference(got, want) <= TOLERANCE


def test_the_plan_splits_activations_and_adds_the_all_to_alls():
    """plan_memory(context_parallel=C): one rank's part of each sequence (activations and compute / C), the model
    state sharded over data-parallel x context-parallel ranks, and the all-to-alls of attention in the forecast."""
    from examples.llama import LlamaConfig
    from strategies.plan import plan_memory

    config = LlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=8, n_kv_heads=4, hidden_dim=352, max_seq_len=4096)
    with torch.device("meta"):
        model = Llama(config)
    plans = {
        cp: plan_memory(model, world_size=4, batch_size=1, seq_len=4096, context_parallel=cp, hardware="cpu")
        for cp in (1, 2, 4)
    }
    for cp in (2, 4):
        assert plans[cp].activations == pytest.approx(plans[1].activations / cp, rel=0.05)
        assert plans[cp].strategies["fsdp"].model_state == plans[1].strategies["fsdp"].model_state
        assert plans[cp].forecasts["fsdp"].comm_s > plans[1].forecasts["fsdp"].comm_s
        assert plans[cp].forecasts["fsdp"].compute_s == pytest.approx(
            plans[1].forecasts["fsdp"].compute_s / cp, rel=0.1
        )
    with pytest.raises(ValueError, match="seq_len=4095 does not split into context_parallel=2"):
        plan_memory(model, world_size=2, seq_len=4095, context_parallel=2)
    with pytest.raises(ValueError, match="tensor_parallel=1 x context_parallel=3 does not divide world_size=4"):
        plan_memory(model, world_size=4, seq_len=4096, context_parallel=3)


def body_auto_context_parallel() -> tuple[int, str, int]:
    """strategy="auto" with a budget that one sequence fits only when split in two."""
    loader = DataLoader(tokens(8), batch_size=2)
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    whole = Trainer(strategy="auto", devices=2, **quiet).plan(LM("llama"), train_dataloaders=loader)
    split = Trainer(strategy=DDPStrategy(context_parallel_size=2), devices=2, **quiet).plan(
        LM("llama"), train_dataloaders=loader
    )
    budget = (min(r.total for r in whole.strategies.values()) + min(r.total for r in split.strategies.values())) // 2
    trainer = Trainer(strategy="auto", devices=2, max_steps=1, max_memory_per_rank=budget, **quiet)
    trainer.fit(LM("llama"), loader)
    return trainer.strategy.context_parallel_size, trainer.strategy.name, budget


def test_auto_strategy_splits_a_sequence_that_fits_no_rank_whole(rank_pool):
    """When no strategy fits a rank, with or without tensor parallel, strategy="auto" tries context-parallel
    sizes: here 2, with the least-communicating strategy that then fits."""
    (cp, name, budget), _ = rank_pool(2).run(body_auto_context_parallel)
    assert cp == 2, (cp, name, budget)


class SequenceFirst(LM):
    """Batches laid out (sequence, batch), as torch's nn.Transformer without batch_first takes them: the module
    says so with sequence_dims."""

    def sequence_dims(self, batch):
        return (0, 0)

    def training_step(self, batch, batch_idx):
        x, y = (t.T for t in batch)
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())


def sequence_first(samples: int = 24) -> TensorDataset:
    x, y = tokens(samples).tensors
    return TensorDataset(x, y)


def transposed(batch):
    return tuple(torch.stack(column).T for column in zip(*batch))


def body_sequence_dims() -> dict | None:
    trainer = quiet_trainer(FSDPStrategy(context_parallel_size=2), 2)
    trainer.fit(SequenceFirst("gpt"), DataLoader(sequence_first(), batch_size=PER_RANK_BATCH, collate_fn=transposed))
    state = trainer.strategy.full_state_dict()
    return state if is_rank_zero() else None


def test_a_module_names_the_sequence_dimension_of_its_batches(rank_pool):
    """sequence_dims: a batch of (sequence, batch) tensors is split along dimension 0, as the module says."""
    got = rank_pool(2).run(body_sequence_dims)[0]
    assert max_relative_difference(got, one_process("gpt", 1)) <= TOLERANCE
