"""Things that react to loop events: progress bar, checkpointing policy, early stopping, learning-rate
logging, a moving average of the weights, and the experiment loggers they write to."""

from callbacks.base import Callback
from callbacks.early_stopping import EarlyStopping
from callbacks.ema import EMA
from callbacks.loggers import Logger, TensorBoardLogger
from callbacks.lr_monitor import LearningRateMonitor
from callbacks.model_checkpoint import ModelCheckpoint
from callbacks.model_summary import ModelSummary
from callbacks.progress import ProgressBar
from callbacks.throughput import ThroughputMonitor

__all__ = [
    "Callback",
    "EMA",
    "EarlyStopping",
    "LearningRateMonitor",
    "Logger",
    "ModelCheckpoint",
    "ModelSummary",
    "ProgressBar",
    "TensorBoardLogger",
    "ThroughputMonitor",
]
