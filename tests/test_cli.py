"""The LightningCLI-style command line (trainer.cli.CLI): a Lightning CLI script and its YAML run with only the
imports changed and end with the same weights as the same run started from Python (and as under Lightning itself);
typos, wrong types and keys in the wrong section are errors that say where they came from; precedence is defaults
< files in order < flags; the resolved config is saved beside the logs and in every checkpoint, given to the
loggers, and `fit --ckpt_path last` resumes with it; `devices=2` re-runs the command unchanged."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from callbacks import CSVLogger
from trainer import Trainer, seed_everything
from trainer.checkpoint import find_last, load_full_state_dict

pytest.importorskip("jsonargparse")
from trainer.cli import CLI, ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "cli_regression.py"
YAML = ROOT / "tests" / "scripts" / "cli_regression.yaml"
OPTIMIZER_YAML = ROOT / "tests" / "scripts" / "cli_regression_optimizer.yaml"
script = importlib.import_module("tests.scripts.cli_regression")


def cli(*args: str, **kwargs) -> CLI:
    """The script's CLI in this process, raising ConfigError instead of exiting."""
    return CLI(
        script.Regressor, script.RegressionData, args=list(args), parser_kwargs={"exit_on_error": False}, **kwargs
    )


def refused(*args: str) -> str:
    with pytest.raises(ConfigError) as raised:
        cli(*args)
    return str(raised.value)


def run_script(*args: str, backend: str = "shardtrain", timeout: float = 180) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED")
    }
    env.update(OMP_NUM_THREADS="1", CLI_BACKEND=backend, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc


def last_weights(root: Path) -> dict[str, torch.Tensor]:
    ckpts = sorted(root.rglob("*.ckpt"))
    if ckpts:  # Lightning's
        return torch.load(ckpts[-1], weights_only=False)["state_dict"]
    return load_full_state_dict(find_last(*[str(p) for p in root.rglob("checkpoints")]))


def python_run(root: Path, momentum: float = 0.9) -> dict[str, torch.Tensor]:
    """What cli_regression.yaml + cli_regression_optimizer.yaml configure, written in Python."""
    seed_everything(7)
    model = script.Regressor(hidden=6, lr=0.05)
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    data = script.RegressionData(batch_size=8, num_samples=32)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        limit_val_batches=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )
    trainer.fit(model, datamodule=data)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- the same run, three ways ---------------------------------------------------------------------------------
@pytest.mark.distributed  # runs the script in processes of its own
def test_cli_script_and_yaml_end_with_the_weights_of_the_python_run_and_of_lightning(tmp_path):
    run_script(
        "fit",
        "--config",
        str(YAML),
        "--config",
        str(OPTIMIZER_YAML),
        "--trainer.default_root_dir",
        str(tmp_path / "cli"),
    )
    expected = python_run(tmp_path / "python")
    ours = last_weights(tmp_path / "cli")
    assert set(ours) == set(expected)
    for key in expected:
        torch.testing.assert_close(ours[key], expected[key], rtol=0, atol=0, msg=key)
    # the same script and files under Lightning's own LightningCLI (only the imports differ)
    pytest.importorskip("lightning")
    run_script(
        "fit",
        "--config",
        str(YAML),
        "--config",
        str(OPTIMIZER_YAML),
        "--trainer.default_root_dir",
        str(tmp_path / "lightning"),
        backend="lightning",
    )
    theirs = last_weights(tmp_path / "lightning")
    for key in expected:
        torch.testing.assert_close(theirs[key], expected[key], rtol=1e-6, atol=1e-7, msg=key)
    # and the config Lightning saved (every Trainer key, Lightning-only ones at their defaults) runs here unchanged
    lightning_config = next((tmp_path / "lightning").rglob("config.yaml"))
    again = cli("fit", "--config", str(lightning_config), "--trainer.default_root_dir", str(tmp_path / "again"))
    for key, value in again.model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)


def test_resolved_config_is_saved_beside_the_logs_in_every_checkpoint_and_given_to_the_loggers(tmp_path):
    run = cli(
        "fit",
        "--config",
        str(YAML),
        "--trainer.max_epochs",
        "1",
        "--trainer.logger",
        "callbacks.CSVLogger",
        "--trainer.logger.save_dir",
        str(tmp_path / "logs"),
    )
    assert isinstance(run.trainer.logger, CSVLogger)
    log_dir = Path(run.trainer.log_dir)
    saved = (log_dir / "config.yaml").read_text()
    assert "# Precedence: defaults < config files in the order given < command line flags" in saved
    assert f"--config {YAML}" in saved.splitlines()[1]
    values = yaml.safe_load(saved)
    assert values["trainer"]["max_epochs"] == 1 and values["model"] == {"hidden": 6, "lr": 0.05}
    assert values["seed_everything"] == 7
    checkpoints = [p for p in (log_dir / "checkpoints").iterdir() if p.is_dir()]
    assert checkpoints and all((p / "config.yaml").read_text() == saved for p in checkpoints)
    hparams = yaml.safe_load((log_dir / "hparams.yaml").read_text())  # what CSVLogger.log_hyperparams got
    assert hparams["trainer"]["max_epochs"] == 1 and hparams["data"]["num_samples"] == 32


def test_fit_ckpt_path_last_resumes_with_the_saved_config_under_the_command_line(tmp_path):
    root = str(tmp_path / "runs")
    first = cli(
        "fit",
        "--config",
        str(YAML),
        "--model.hidden",
        "5",
        "--trainer.max_epochs",
        "1",
        "--trainer.default_root_dir",
        root,
    )
    assert first.trainer.global_step == 4
    # no --config: the model's width (5, not the default 8) comes from the config saved in the checkpoint
    resumed = cli("fit", "--ckpt_path", "last", "--trainer.max_epochs", "2", "--trainer.default_root_dir", root)
    assert resumed.resumed_from is not None and resumed.resumed_from.endswith("config.yaml")
    assert resumed.model.net[0].out_features == 5 and resumed.datamodule.num_samples == 32
    assert resumed.trainer.global_step == 8 and resumed.trainer.max_epochs == 2  # the flag wins over the saved 1


@pytest.mark.distributed  # runs the script in processes of its own
def test_devices_2_re_runs_the_same_command_on_every_rank(tmp_path):
    run_script(
        "fit",
        "--config",
        str(YAML),
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp",
        "--trainer.max_epochs",
        "1",
        "--trainer.default_root_dir",
        str(tmp_path),
    )
    configs = sorted(tmp_path.rglob("config.yaml"))
    log_configs = [p for p in configs if p.parent.name.startswith("version_")]
    assert len(log_configs) == 1, configs  # saved once (rank 0)
    assert yaml.safe_load(log_configs[0].read_text())["trainer"]["devices"] == 2
    assert any("checkpoints" in p.parts for p in configs)


# ---- precedence, --print_config, --help -----------------------------------------------------------------------
def test_command_line_flags_win_over_config_files_wherever_they_stand(tmp_path, capsys):
    later = tmp_path / "later.yaml"
    later.write_text("trainer:\n  max_epochs: 5\nmodel:\n  lr: 0.5\n")
    with pytest.raises(SystemExit):  # the flag stands before the files, and still wins
        cli("fit", "--trainer.max_epochs", "3", "--config", str(YAML), "--config", str(later), "--print_config")
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["max_epochs"] == 3  # flag > later.yaml (5) > cli_regression.yaml (2)
    assert printed["model"] == {"hidden": 6, "lr": 0.5}  # later file > earlier file > default


def test_help_lists_every_argument_with_type_default_docs_and_the_precedence(capsys):
    with pytest.raises(SystemExit) as exited:
        cli("fit", "--help")
    assert exited.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--trainer.max_epochs" in out and "--model.hidden HIDDEN" in out and "--data.batch_size" in out
    assert "width of the hidden layer. (type: int, default: 8)" in out
    assert "Precedence: defaults < config files in the order given < command line flags" in out
    assert "--ckpt_path" in out and "--optimizer" in out and "--print_config" in out


# ---- misuse: each an error that says what, where and what was meant -------------------------------------------
def test_typo_in_a_config_file_names_the_key_file_line_and_closest_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_epochs: 2\n  max_epoch: 3\nmodel:\n  hidden: 4\n")
    message = refused("fit", "--config", str(bad))
    assert f"unknown key 'trainer.max_epoch' ({bad}, line 3)" in message
    assert "trainer.max_epochs" in message.split("closest valid keys:")[1]


def test_typo_on_the_command_line_names_the_flag_and_closest_keys():
    message = refused("fit", "--config", str(YAML), "--model.hiden", "4")
    assert "unknown key 'model.hiden' (the command line flag --model.hiden)" in message
    assert "closest valid keys: model.hidden" in message


def test_typo_in_a_class_init_args_names_the_class_and_its_arguments(tmp_path):
    bad = tmp_path / "logger.yaml"
    bad.write_text("trainer:\n  logger:\n    class_path: callbacks.CSVLogger\n    init_args:\n      save_dri: x\n")
    message = refused("fit", "--config", str(bad))
    assert f"unknown key 'trainer.logger.init_args.save_dri' ({bad}, line 5)" in message
    assert "CSVLogger takes no argument 'save_dri'" in message and "save_dir" in message
    message = refused("fit", "--trainer.logger", "CSVLogger", "--trainer.logger.save_dri", "x")
    assert "the command line flag --trainer.logger.save_dri" in message and "save_dir" in message


def test_a_key_in_the_wrong_section_is_an_error_naming_its_section(tmp_path):
    bad = tmp_path / "section.yaml"
    bad.write_text("model:\n  hidden: 4\n  max_epochs: 3\n")
    message = refused("fit", "--config", str(bad))
    assert f"unknown key 'model.max_epochs' ({bad}, line 3)" in message
    assert "'max_epochs' is a key of another section: trainer.max_epochs" in message
    message = refused("fit", "--data.hidden", "4")
    assert "'hidden' is a key of another section: model.hidden" in message


def test_a_value_of_the_wrong_type_names_the_expected_type_and_where_it_came_from(tmp_path):
    message = refused("fit", "--config", str(YAML), "--trainer.max_epochs", "ten")
    assert "trainer.max_epochs = ten (the command line flag --trainer.max_epochs): expected int | None" in message
    bad = tmp_path / "type.yaml"
    bad.write_text("model:\n  hidden: 2.5\n")
    message = refused("fit", "--config", str(bad))
    assert f"model.hidden = 2.5 ({bad}, line 2): expected int" in message


def test_a_lightning_only_trainer_argument_is_refused_unless_at_lightnings_default(tmp_path):
    config = tmp_path / "lightning.yaml"
    config.write_text("trainer:\n  benchmark: null\n  inference_mode: true\n  precision: null\n  min_epochs: 3\n")
    message = refused("fit", "--config", str(config))
    assert "trainer.min_epochs: 3" in message and "Lightning Trainer argument this Trainer does not support" in message


def test_errors_exit_with_status_2_and_the_message_on_the_command_line(capsys):
    with pytest.raises(SystemExit) as exited:  # as `python script.py fit --model.lrr 1` ends
        CLI(script.Regressor, script.RegressionData, args=["fit", "--model.lrr", "1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and "error: unknown key 'model.lrr' (the command line flag --model.lrr)" in err


def test_jsonargparse_is_an_optional_dependency_named_when_missing(monkeypatch):
    for name in [n for n in sys.modules if n == "trainer.cli" or n.startswith("trainer.cli.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "jsonargparse", None)
    with pytest.raises(ImportError, match=r'pip install "shardtrain\[cli\]"'):
        importlib.import_module("trainer.cli")


def test_subclass_mode_takes_class_path_and_init_args(tmp_path, capsys):
    config = tmp_path / "subclass.yaml"
    config.write_text(
        "model:\n  class_path: tests.scripts.cli_regression.Regressor\n  init_args:\n    hidden: 3\n"
        "data:\n  class_path: tests.scripts.cli_regression.RegressionData\n"
    )
    args = ["fit", "--config", str(config), "--model.init_args.lr", "0.2", "--print_config"]
    with pytest.raises(SystemExit):
        CLI(args=args, parser_kwargs={"exit_on_error": False})  # no classes given: any TrainModule / DataModule
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] == "tests.scripts.cli_regression.Regressor"
    assert printed["model"]["init_args"] == {"hidden": 3, "lr": 0.2}
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'model.init_args.hiden' \(the command line flag "
        r"--model.init_args.hiden\): Regressor takes no argument 'hiden'",
    ):
        CLI(
            script.Regressor,
            script.RegressionData,
            subclass_mode_model=True,
            parser_kwargs={"exit_on_error": False},
            args=["fit", "--model", "Regressor", "--model.init_args.hiden", "4"],
        )


def test_run_false_builds_the_objects_without_subcommands():
    built = CLI(
        script.Regressor,
        script.RegressionData,
        run=False,
        parser_kwargs={"exit_on_error": False},
        args=["--model.hidden", "3", "--trainer.max_epochs", "1", "--trainer.logger", "false"],
    )
    assert built.model.net[0].out_features == 3 and built.trainer.max_epochs == 1
    assert built.trainer.global_step == 0 and built.subcommand is None


def test_a_function_that_builds_the_model_is_configured_by_its_signature(capsys):
    def small_regressor(width: int = 2) -> script.Regressor:
        """A narrow model.

        Args:
            width: the hidden width.
        """
        return script.Regressor(hidden=width)

    built = CLI(
        small_regressor,
        script.RegressionData,
        run=False,
        parser_kwargs={"exit_on_error": False},
        args=["--model.width", "3", "--trainer.logger", "false"],
    )
    assert isinstance(built.model, script.Regressor) and built.model.net[0].out_features == 3


def test_a_section_in_a_file_of_its_own_is_read_relative_to_its_config(tmp_path, capsys):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "run.yaml").write_text("trainer:\n  max_epochs: 4\nmodel: model.yaml\n")
    (tmp_path / "conf" / "model.yaml").write_text("hidden: 5\n")
    with pytest.raises(SystemExit):
        cli("fit", "--config", str(tmp_path / "conf" / "run.yaml"), "--print_config")
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["hidden"] == 5 and printed["trainer"]["max_epochs"] == 4


def test_ckpt_path_last_looks_where_the_configured_model_checkpoint_saves(tmp_path):
    flags = [
        "--config",
        str(YAML),
        "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.dirpath",
        str(tmp_path / "ckpt"),
        "--trainer.logger",
        "false",
    ]
    cli(
        "fit",
        *flags,
        "--model.hidden",
        "5",
        "--trainer.max_epochs",
        "1",
        "--trainer.default_root_dir",
        str(tmp_path / "first"),
    )
    resumed = cli(
        "fit",
        "--ckpt_path",
        "last",
        "--trainer.max_epochs",
        "2",
        "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.dirpath",
        str(tmp_path / "ckpt"),
        "--trainer.logger",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path / "second"),
    )
    assert resumed.resumed_from.startswith(str(tmp_path / "ckpt"))
    assert resumed.model.net[0].out_features == 5 and resumed.trainer.global_step == 8
