"""The LightningCLI-style command line: `trainer.cli.CLI(MyModel, MyDataModule)` (main.py), the checks of every key
and value with where it came from (checks.py, sources.py), and the saved config of a run (saved.py).

jsonargparse is an optional dependency: `pip install "shardtrain[cli]"`.
"""

try:
    import jsonargparse  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        'trainer.cli needs jsonargparse (an optional dependency): pip install "shardtrain[cli]"'
    ) from error

from .checks import ConfigError
from .main import CLI
from .saved import SaveConfigCallback

__all__ = ["CLI", "ConfigError", "SaveConfigCallback"]
