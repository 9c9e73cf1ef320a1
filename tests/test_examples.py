"""The examples run end to end: MNIST from idx files written here, the GPT quickstart and the LoRA fine-tuning at a
tiny size."""

from __future__ import annotations

import contextlib
import importlib
import io
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from examples import gpt, mnist

pytestmark = pytest.mark.distributed  # the tests here start processes (nearly all of them)

ROOT = Path(__file__).resolve().parents[1]


def write_idx(path: Path, data: torch.Tensor) -> None:
    """The MNIST idx format: big-endian magic (0, 0, type 0x08 = ubyte, ndim), the dimensions, the bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, data.dim()) + struct.pack(f">{data.dim()}I", *data.shape)
    path.write_bytes(header + data.to(torch.uint8).contiguous().numpy().tobytes())


def write_mnist(root: Path, num_train: int = 64, num_test: int = 32) -> None:
    """Digit-like images in <root>/MNIST/raw/, named as torchvision expects them after download."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for prefix, n in (("train", num_train), ("t10k", num_test)):
        labels = torch.randint(0, 10, (n,), generator=gen)
        images = torch.randint(0, 40, (n, 28, 28), generator=gen)
        for i, label in enumerate(labels.tolist()):  # a bright bar whose position is the label: learnable
            images[i, 4:24, 2 + 2 * label : 4 + 2 * label] = 255
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mnist")
    write_mnist(root)
    return root


def run_example(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{module} exited with {proc.returncode}\n{output}"
    return proc


def test_mnist_loads_idx_files(mnist_dir: Path) -> None:
    train, test = mnist.mnist_loaders(str(mnist_dir), batch_size=16, test_batch_size=1000, download=False)
    assert len(train.dataset) == 64 and len(test.dataset) == 32
    x, y = next(iter(test))
    assert x.shape == (32, 1, 28, 28) and y.shape == (32,) and y.dtype == torch.int64
    assert x.max() == pytest.approx((1 - 0.1307) / 0.3081, rel=1e-5)  # normalized as the recipe says
    assert mnist.Net()(x).shape == (32, 10)


def test_mnist_without_files_says_so(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"Dataset not found: with --no-download .* must be in .*MNIST/raw"):
        mnist.mnist_loaders(str(tmp_path), 64, 1000, download=False)


def _main_output(example: str, argv: list[str]) -> str:
    """A rank body for the pool: the example's main() on this rank, returning what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        importlib.import_module(f"examples.{example}").main(argv)
    return out.getvalue()


def mnist_argv(data_dir: Path, root_dir: Path, *extra: str) -> list[str]:
    return [
        "--epochs",
        "2",
        "--limit-train-batches",
        "2",
        "--batch-size",
        "16",
        "--data-dir",
        str(data_dir),
        "--no-download",
        "--root-dir",
        str(root_dir),
        *extra,
    ]


def test_mnist_runs_on_one_rank(mnist_dir: Path, tmp_path: Path) -> None:
    out = _main_output("mnist", mnist_argv(mnist_dir, tmp_path / "runs", "--devices", "1"))
    assert "on 1 rank(s): training time" in out and "val/acc" in out
    assert list((tmp_path / "runs").rglob("events.out.tfevents.*"))


def test_mnist_runs_on_two_ranks_with_ddp(rank_pool, mnist_dir: Path, tmp_path: Path) -> None:
    argv = mnist_argv(mnist_dir, tmp_path / "runs", "--devices", "2", "--strategy", "ddp")
    rank0, rank1 = rank_pool(2).run(_main_output, "mnist", argv)
    assert "strategy ddp on 2 rank(s): training time" in rank0
    assert "memory report" in rank0
    assert rank1 == ""  # only rank 0 prints


def test_cli_mnist_runs_tiny_from_its_yaml(mnist_dir: Path, tmp_path: Path) -> None:
    """examples/cli_mnist.py with examples/cli_mnist.yaml, a flag or two making it tiny: trains, saves its config."""
    pytest.importorskip("jsonargparse")
    cli_mnist = importlib.import_module("examples.cli_mnist")
    run = cli_mnist.main(
        [
            "fit",
            "--config",
            str(ROOT / "examples" / "cli_mnist.yaml"),
            "--data.data_dir",
            str(mnist_dir),
            "--data.download",
            "false",
            "--data.batch_size",
            "16",
            "--trainer.max_epochs",
            "1",
            "--trainer.limit_train_batches",
            "2",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
    assert run.trainer.global_step == 2 and "val/acc" in run.trainer.callback_metrics
    saved = (Path(run.trainer.log_dir) / "config.yaml").read_text()
    assert "max_epochs: 1" in saved and "class_path: callbacks.LearningRateMonitor" in saved
    assert list(Path(run.trainer.log_dir).glob("checkpoints/*/config.yaml"))


def test_gpt_data_is_deterministic_and_split_by_file() -> None:
    train, val = gpt.build_datasets(block_size=32, max_bytes=200_000, val_windows=64)
    again_train, again_val = gpt.build_datasets(block_size=32, max_bytes=200_000, val_windows=64)
    assert torch.equal(train.data, again_train.data) and torch.equal(val.data, again_val.data)
    assert len(train.data) >= 200_000 * 0.6 and 0 < len(val.data) < len(train.data)
    assert 60 <= len(val) <= 70
    x, y = train[3]
    assert x.shape == y.shape == (32,) and torch.equal(x[1:], y[:-1])
    assert torch.equal(x, train.data[3 * 16 : 3 * 16 + 32].long())  # windows overlap by half a block
    assert bytes(train.data[:4].tolist()).isascii()
    with pytest.raises(IndexError):
        train[len(train)]


def test_gpt_model_ties_head_and_embedding() -> None:
    config = gpt.GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = gpt.GPT(config)
    assert model.lm_head.weight is model.wte.weight
    assert model.num_parameters() == sum(p.numel() for p in model.state_dict().values()) - 256 * 32
    logits = model(torch.randint(0, 256, (3, 16)))
    assert logits.shape == (3, 16, 256)
    assert gpt.GPT(gpt.GPT_PRESETS["30m"]).num_parameters() == pytest.approx(30e6, rel=0.1)


def test_gpt_built_on_meta_and_reset_layer_by_layer_equals_eager() -> None:
    """As sharded strategies build configure_model: each layer's reset_parameters() gives the eager values."""
    config = gpt.GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    eager = gpt.GPT(config)
    torch.manual_seed(0)
    with torch.device("meta"):
        lazy = gpt.GPT(config)
    lazy.to_empty(device="cpu")  # unties the head: each holder is reset, the first (wte) keeps its values
    for module in lazy.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.reset_parameters()
    lazy.lm_head.weight = lazy.wte.weight
    for (name, p), q in zip(eager.named_parameters(), lazy.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert eager.h[0].attn.c_proj.weight.std() < 0.75 * eager.h[0].attn.c_attn.weight.std()  # scaled by depth


def test_gpt_quickstart_command_runs_tiny_on_two_ranks(tmp_path: Path) -> None:
    """The README quickstart as the user types it (a script that starts its second rank), at a tiny size."""
    proc = run_example(
        "examples.gpt",
        "--devices",
        "2",
        "--max-steps",
        "4",
        "--val-check-interval",
        "2",
        "--batch-size",
        "8",
        "--block-size",
        "16",
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--n-embd",
        "32",
        "--data-bytes",
        "100000",
        "--val-windows",
        "17",  # 2 batches and 1
        "--sample-tokens",
        "8",
        "--root-dir",
        str(tmp_path / "runs"),
    )
    out = proc.stdout
    val_losses = [float(v) for v in re.findall(r"^step +\d+ +val/loss (\S+)$", out, re.MULTILINE)]
    assert len(val_losses) == 2, out
    assert "2 rank(s), strategy ddp" in out and "tensorboard --logdir" in out and "sample from" in out
    assert out.count("training took") == 1, out  # only rank 0 prints
    events = [str(p.parent) for p in (tmp_path / "runs").rglob("events.out.tfevents.*")]
    assert events, "no TensorBoard event file written"
    scalars = EventAccumulator(events[0])
    scalars.Reload()
    assert {"val/loss", "lr-AdamW/pg1", "lr-AdamW/pg2"} <= set(scalars.Tags()["scalars"]), scalars.Tags()
    assert [e.step for e in scalars.Scalars("val/loss")] == [2, 4]
    checkpoints = [p.name for p in (tmp_path / "runs").rglob("checkpoints/*") if p.is_dir()]
    assert "last" in checkpoints and len(checkpoints) == 2, checkpoints


def test_finetune_lora_example_runs_tiny_on_two_ranks(rank_pool, tmp_path: Path) -> None:
    """examples/finetune_lora.py at a tiny size under fsdp: a pretrained folder made, the base loaded from it, the
    adapter trained, saved by peft from rank 0 and loaded back in one process with the last validation's loss."""
    pytest.importorskip("peft")
    argv = [
        "--devices",
        "2",
        "--max-steps",
        "4",
        "--val-check-interval",
        "2",
        "--batch-size",
        "8",
        "--block-size",
        "16",
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--hidden-size",
        "32",
        "--data-bytes",
        "100000",
        "--val-windows",
        "17",
        "--pretrained",
        str(tmp_path / "pretrained"),
        "--adapter-dir",
        str(tmp_path / "adapter"),
        "--root-dir",
        str(tmp_path / "runs"),
    ]
    rank0, rank1 = rank_pool(2).run(_main_output, "finetune_lora", argv)
    val_losses = [float(v) for v in re.findall(r"^step +\d+ +val/loss (\S+)$", rank0, re.MULTILINE)]
    assert len(val_losses) == 2 and val_losses[-1] < math.log(256), rank0
    assert "on 2 rank(s) with fsdp" in rank0 and rank1 == ""
    held = [int(n) for n in re.search(r"trainable elements held per rank: \[(\d+), (\d+)\]", rank0).groups()]
    assert abs(held[0] - held[1]) <= 0.1 * sum(held) / 2, held
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "adapter"))
    reloaded = float(re.search(r"reloaded in one process .*: val/loss (\S+)", rank0).group(1))
    assert reloaded == pytest.approx(val_losses[-1], abs=1e-4)  # the adapter as trained, on the pretrained base
