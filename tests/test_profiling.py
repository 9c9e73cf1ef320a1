"""Where a step's time goes, on real ranks: the step timer behind every fit (forward, backward, optimizer, and per
collective kind the time in flight and the exposed part), `profiler="simple"`'s table, the `time/*` metrics in the
logger, and `PyTorchProfiler`'s chrome traces with the engine's named ranges."""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

from callbacks import CSVLogger
from strategies import FSDPStrategy, observe
from tests.test_parity import Block, TiedLM, new_model, token_dataset
from trainer import Trainer
from trainer.profilers import PyTorchProfiler, SimpleProfiler

STEPS = 4
PHASES = ("forward", "backward", "optimizer", "step")


def _fit(root: str, **kwargs) -> Trainer:
    trainer = Trainer(
        strategy=FSDPStrategy(auto_wrap_policy={Block}),
        devices=2,
        max_steps=STEPS,
        max_epochs=1,
        default_root_dir=root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )
    trainer.fit(new_model(TiedLM), DataLoader(token_dataset(), batch_size=2))
    return trainer


def _simple_body(root: str) -> dict:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = _fit(root, profiler="simple", log_every_n_steps=1, logger=CSVLogger(root, name="csv"))
    return {"printed": printed.getvalue(), "csv": trainer.logger.log_dir, "watched": observe.watching()}


def test_simple_profiler_prints_the_table_and_the_logger_gets_time_metrics(rank_pool, tmp_path):
    results = rank_pool(2).run(_simple_body, str(tmp_path))

    table = results[0]["printed"]
    assert results[1]["printed"] == ""  # rank 0 prints, for every rank
    for row in (
        "forward",
        "backward",
        "optimizer",
        "optimizer step (wall)",
        "all_gather",
        "reduce_scatter",
        "unit 'blocks.0'",
        "unit 'blocks.1'",
        "exposed",
        "all_reduce",
    ):
        assert row in table, row
    assert "Mean (ms)" in table and "Total (s)" in table and "slowest rank" in table
    assert not results[0]["watched"] and not results[1]["watched"]  # nothing watches the collectives after fit

    metrics = pd.read_csv(os.path.join(results[0]["csv"], "metrics.csv"))
    timed = metrics.dropna(subset=["time/forward"])
    assert list(timed["step"]) == list(range(1, STEPS + 1))  # every log_every_n_steps (here 1)
    for name in [f"time/{phase}" for phase in PHASES] + ["time/all_gather", "time/reduce_scatter"]:
        assert (timed[name] > 0).all(), name
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):  # the exposed part is within the time in flight
        assert (timed[f"time/{kind}_exposed"] <= timed[f"time/{kind}"] + 1e-9).all(), kind
    assert (timed["time/forward"] + timed["time/backward"] + timed["time/optimizer"] <= timed["time/step"]).all()


def _pytorch_body(root: str) -> list[str]:
    schedule = torch.profiler.schedule(wait=1, warmup=0, active=2, repeat=1)  # steps 2 and 3
    _fit(root, profiler=PyTorchProfiler(dirpath=root, schedule=schedule), logger=False)
    return sorted(glob.glob(os.path.join(root, f"rank{os.environ['RANK']}*.pt.trace.json")))


def test_pytorch_profiler_writes_a_chrome_trace_per_rank_with_the_engines_named_ranges(rank_pool, tmp_path):
    traces = rank_pool(2).run(_pytorch_body, str(tmp_path))

    for rank, files in enumerate(traces):
        assert len(files) == 1, files  # one trace per rank, in TensorBoard's profiler plugin's naming
        with open(files[0]) as f:
            trace = json.load(f)  # Perfetto and chrome://tracing read this JSON
        names = {event.get("name", "") for event in trace["traceEvents"]}
        for expected in (
            "shardtrain/all_gather blocks.0",
            "shardtrain/wait all_gather blocks.0",
            "shardtrain/forward blocks.1",
            "shardtrain/training_step",
            "shardtrain/backward",
            "shardtrain/optimizer_step",
        ):
            assert expected in names, (rank, expected, sorted(n for n in names if "shardtrain" in n))
        # Small units' reductions are one collective, named by its units: "reduce_scatter blocks.1+blocks.0+<root>".
        reductions = [
            n.removeprefix("shardtrain/reduce_scatter ").split("+")
            for n in names
            if n.startswith("shardtrain/reduce_scatter ")
        ]
        assert any("blocks.1" in units for units in reductions), (rank, reductions)
        assert trace.get("distributedInfo", {}).get("rank") == rank


def test_profiler_names_and_objects_are_checked_before_anything_starts():
    assert isinstance(Trainer(profiler="simple", logger=False).profiler, SimpleProfiler)
    assert isinstance(Trainer(profiler="pytorch", logger=False).profiler, PyTorchProfiler)
    assert Trainer(logger=False).profiler is None
    with pytest.raises(ValueError, match=r"profiler='advanced'.*'simple', 'pytorch'"):
        Trainer(profiler="advanced")
    with pytest.raises(TypeError, match=r"profiler"):
        Trainer(profiler=3)
