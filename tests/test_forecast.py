"""The step-time forecast of the plan: FLOPs counted on fake tensors, collectives timed on a link model, the
engine's schedule replayed; the command line's columns and JSON keys, and the link fitted from a sweep."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from strategies.plan import FORECAST_KEYS, HARDWARE, Link, get_hardware, plan_memory
from strategies.plan.__main__ import main as plan_main
from strategies.plan.hardware import with_changes
from strategies.plan.link import collective_seconds
from strategies.plan.measure import fit_link
from tests.test_parity import Block, TiedLM

H100 = HARDWARE["h100"]


class Linears(nn.Module):
    """A stack of bias-free square Linear layers: 2 * width**2 FLOPs per layer per sample forward, nothing else."""

    def __init__(self, layers: int = 4, width: int = 256) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def example_input(self, batch_size: int, seq_len: int | None) -> torch.Tensor:
        return torch.empty(batch_size, self.layers[0].in_features)


def test_the_model_flops_are_six_times_parameters_times_samples():
    model = Linears(layers=4, width=256)
    plan = plan_memory(model, world_size=1, batch_size=8, hardware="h100")
    forecast = plan.forecasts["ddp"]
    flops = 6 * 4 * 256 * 256 * 8
    assert forecast.mfu == pytest.approx(flops / forecast.step_s / H100.peak_flops["float32"])
    assert forecast.exposed_comm_s == 0 and forecast.comm_s == 0  # one rank: nothing to send


def test_collective_times_follow_the_ring_and_tree_formulas():
    link = Link(bandwidth=100e9, latency=1e-6)
    assert collective_seconds("all_gather", 8 * 10**9, 8, link) == pytest.approx(7 / 8 * 0.08 + 7e-6)
    assert collective_seconds("reduce_scatter", 8 * 10**9, 8, link) == pytest.approx(7 / 8 * 0.08 + 7e-6)
    ring = 2 * 7 / 8 * 0.08 + 14e-6
    assert collective_seconds("all_reduce", 8 * 10**9, 8, link) == pytest.approx(ring)
    # tiny messages over many ranks: the tree's log-depth latency wins
    assert collective_seconds("all_reduce", 1024, 1024, link) == pytest.approx(2 * 1024 / 100e9 + 20e-6)
    assert collective_seconds("all_gather", 10**6, 1, link) == 0
    with pytest.raises(ValueError, match="broadcast.*all_gather"):
        collective_seconds("broadcast", 1, 2, link)


def test_free_links_expose_nothing_and_slow_links_expose_what_cannot_overlap():
    model = TiedLM()
    fast = with_changes(H100, intra_node=Link(1e30, 0.0), inter_node=Link(1e30, 0.0))
    slow = with_changes(H100, inter_node=Link(1e6, 1e-3))
    common = dict(world_size=16, nodes=2, batch_size=2, seq_len=16, wrap_policy={Block})
    free = plan_memory(model, hardware=fast, **common).forecasts
    for name, f in free.items():
        assert f.exposed_comm_s == pytest.approx(0, abs=1e-12), name
        assert f.step_s == pytest.approx(f.compute_s + f.optimizer_s), name
    costly = plan_memory(model, hardware=slow, **common).forecasts
    for name in free:
        assert costly[name].step_s > free[name].step_s, name
    # hsdp sends only a 1/8 shard of each gradient across the slow link, fsdp everything, twice gathered
    assert costly["hsdp"].exposed_comm_s < costly["fsdp"].exposed_comm_s


def test_fsdp_overlaps_gathers_with_compute_when_the_link_is_fast_enough():
    """Per unit, a gather that takes less than the unit's compute is hidden, except the first one of each pass."""
    model = TiedLM()
    plan = plan_memory(model, world_size=8, batch_size=64, seq_len=16, wrap_policy={Block}, hardware="h100")
    fsdp = plan.forecasts["fsdp"]
    assert fsdp.comm_s > 0
    assert fsdp.exposed_comm_s < fsdp.comm_s


def test_the_command_line_prints_the_forecast_columns_and_json_keys(capsys):
    args = [
        "examples.llama:llama_tiny",
        "--world-size",
        "16",
        "--nodes",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "64",
        "--wrap",
        "Block",
        "--hardware",
        "a100",
        "--precision",
        "bf16-mixed",
    ]
    plan_main(args)
    table = capsys.readouterr().out
    assert "step time on a100" in table and "tokens/s/rank" in table and "MFU" in table and "exposed comm" in table
    plan_main([*args, "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert list(plan) == ["ddp", "zero1", "zero2", "hsdp", "fsdp"]
    for name, row in plan.items():
        assert set(FORECAST_KEYS) <= set(row), name
        assert row["step_s"] > 0 and 0 < row["mfu"] < 1, (name, row)
        assert row["tokens_per_s_per_rank"] == pytest.approx(2 * 64 / row["step_s"])
        assert 0 <= row["exposed_comm_s"] < row["step_s"]


def test_a_bad_hardware_name_lists_the_choices(capsys, tmp_path):
    with pytest.raises(ValueError, match=r"hardware='tpu'.*\['a100', 'cpu', 'h100', 'h200'\]"):
        get_hardware("tpu")
    with pytest.raises(SystemExit):
        plan_main(["examples.llama:llama_tiny", "--seq-len", "8", "--save-hardware", str(tmp_path / "x.json")])
    assert "--save-hardware: give --measure too" in capsys.readouterr().err


def test_a_measured_profile_round_trips_through_its_json_file(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(H100.to_json()))
    assert get_hardware(str(path)) == H100


def test_the_link_fit_recovers_latency_and_bandwidth_of_a_ring():
    truth = Link(bandwidth=2e9, latency=50e-6)
    samples = [
        (kind, nbytes, collective_seconds(kind, nbytes, 2, truth))
        for kind in ("all_gather", "reduce_scatter")
        for nbytes in (4096, 2**16, 2**20, 2**24)
    ]
    samples += [("all_reduce", n, 2 * (n / 2 / truth.bandwidth + truth.latency)) for n in (4096, 2**20, 2**24)]
    fitted = fit_link(samples, 2)
    assert math.isclose(fitted.bandwidth, truth.bandwidth, rel_tol=1e-6)
    assert math.isclose(fitted.latency, truth.latency, rel_tol=1e-6)


def test_selective_checkpointing_recomputes_less_than_full():
    from examples.llama import Block as LlamaBlock
    from examples.llama import llama_tiny

    with torch.device("meta"):
        model = llama_tiny()
    common = dict(
        world_size=1,
        batch_size=4,
        seq_len=64,
        precision="bf16-mixed",
        hardware="h100",
        activation_checkpointing={LlamaBlock},
    )
    none = plan_memory(model, world_size=1, batch_size=4, seq_len=64, precision="bf16-mixed", hardware="h100")
    full = plan_memory(model, **common).forecasts["ddp"].compute_s
    selective = plan_memory(model, checkpoint_mode="selective", **common).forecasts["ddp"].compute_s
    assert none.forecasts["ddp"].compute_s < selective < full
    with pytest.raises(ValueError, match=r"checkpoint_mode='some'.*\['full', 'selective'\]"):
        plan_memory(model, checkpoint_mode="some", **common)


def test_selective_checkpointing_recomputes_what_the_forward_did_not_save():
    """torchtitan's policy (every second matmul saved) decides each matmul alike in the forward and in the
    recompute. One counter shared by both flipped the parity in the recompute of a block with an odd number of
    matmuls (7 here, as in a Llama block) and handed it the wrong saved outputs: a shape error on an H100 under
    torch 2.11, which asks the policy again in the recompute (2.14 replays the forward's decisions)."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import checkpoint

    from examples.llama import Block as LlamaBlock
    from examples.llama import LlamaConfig
    from strategies.plan.activation_checkpointing import selective_context, selective_policy

    policy, mm = selective_policy(), torch.ops.aten.mm.default
    forward = [policy(SimpleNamespace(is_recompute=False), mm).name for _ in range(7)]
    recompute = [policy(SimpleNamespace(is_recompute=True), mm).name for _ in range(7)]
    assert recompute == forward and forward.count("MUST_SAVE") == 4

    torch.manual_seed(0)
    block = LlamaBlock(
        LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=96, max_seq_len=16)
    )
    x = torch.randn(2, 16, 64, requires_grad=True)
    for _ in range(2):  # a fresh policy per call: the second call decides as the first
        checkpoint(block, x, use_reentrant=False, context_fn=selective_context).sum().backward()
    checkpointed, x.grad = x.grad.clone(), None
    for _ in range(2):
        block(x).sum().backward()
    torch.testing.assert_close(checkpointed, x.grad, rtol=0, atol=0)


def test_a_huggingface_model_is_planned_and_forecast_as_it_comes():
    """A transformers causal LM given as a plain nn.Module returns a ModelOutput: its logits are what is trained."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64))
    plan = plan_memory(
        model,
        world_size=16,
        nodes=2,
        batch_size=2,
        seq_len=32,
        precision="bf16-mixed",
        wrap_policy={GPT2Block},
        hardware="h100",
    )
    assert plan.activations > 0 and set(plan.forecasts) == {"ddp", "zero1", "zero2", "hsdp", "fsdp"}
    assert all(f.step_s > 0 and f.comm_s > 0 for f in plan.forecasts.values())


def test_the_pipeline_forecast_has_each_schedules_bubble_and_its_transfers():
    """Under a pipeline the step is the slowest rank's compute of one micro-batch M + (P - 1) / V times (V stages
    per rank), then the optimizer; a slow link adds the activations sent between stages: on a GPU the pipeline's
    fill and drain wait for them, on the CPU (nothing overlaps) every micro-batch's."""
    from examples.llama import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=256, dim=64, n_layers=8, n_heads=4, n_kv_heads=2, hidden_dim=176, max_seq_len=32)
    with torch.device("meta"):
        model = Llama(config)
    free = with_changes(H100, intra_node=Link(1e30, 0.0), inter_node=Link(1e30, 0.0))
    common = dict(world_size=4, batch_size=8, seq_len=32, pipeline_parallel=4)

    def forecast(hardware, schedule="1F1B", microbatches=4):
        plan = plan_memory(model, hardware=hardware, pipeline_schedule=schedule, pipeline_microbatches=microbatches,
                           **common)  # fmt: skip
        return plan.forecasts["ddp"]

    for schedule, microbatches, slots in (("1F1B", 4, 4 + 3), ("GPipe", 8, 8 + 3), ("Interleaved1F1B", 4, 4 + 1.5)):
        f = forecast(free, schedule, microbatches)
        assert f.step_s - f.optimizer_s == pytest.approx(f.compute_s * slots / microbatches), schedule
        assert f.exposed_comm_s == pytest.approx(0, abs=1e-12)
    # every rank keeps the pace of the one computing the most: at least a quarter of the whole model's compute
    whole = plan_memory(model, hardware=free, world_size=1, batch_size=2, seq_len=32).forecasts["ddp"]
    assert forecast(free).compute_s / 4 >= whole.compute_s / 4
    sent = 2 * 32 * config.dim * 4  # one micro-batch of 2 x 32 tokens of the residual stream, float32
    link = Link(1e9, 1e-5)
    one = sent / 1e9 + 1e-5
    for hardware, transfers in (
        (with_changes(free, intra_node=link), 2 * 3),
        (with_changes(HARDWARE["cpu"], intra_node=link), 2 * 7),
    ):
        slow, fast = forecast(hardware), forecast(with_changes(hardware, intra_node=free.intra_node))
        assert slow.step_s - fast.step_s == pytest.approx(transfers * one), hardware.name


def test_ranks_of_a_pipeline_share_the_cores_only_while_they_compute():
    """--measure on a CPU with more ranks than cores: under a pipeline, slot by slot, only the stages holding a
    micro-batch compute (1F1B's fill and drain leave some waiting), so the ranks compute faster than their even
    share of the cores."""
    from strategies.plan.measure import pipeline_core_share
    from strategies.plan.pipeline_forecast import PipelineShape

    # pp 4, 4 micro-batches, 4 ranks on 2 cores: 1, 2, 3, 4, 3, 2, 1 stages at once over 7 slots, 9 slots long
    assert pipeline_core_share(PipelineShape("1F1B", 4, 4), threads=4, cores=2) == pytest.approx(7 / 9)
    # pp 2 x dp 2 on 2 cores: 2, 4, 4, 4, 2 ranks at once; the fill and drain at full speed
    assert pipeline_core_share(PipelineShape("1F1B", 2, 4), threads=4, cores=2) == pytest.approx(5 / 8)
    assert pipeline_core_share(PipelineShape("1F1B", 2, 4), threads=2, cores=2) == 1.0
