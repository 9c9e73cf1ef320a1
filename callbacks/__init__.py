"""Things that react to loop events: progress bar, checkpointing policy, early stopping, learning-rate
logging, a moving average of the weights, and the experiment loggers they write to (TensorBoard, CSV, MLflow,
Weights & Biases)."""

from callbacks.base import Callback
from callbacks.csv_logger import CSVLogger
from callbacks.early_stopping import EarlyStopping
from callbacks.ema import EMA
from callbacks.loggers import Logger, TensorBoardLogger
from callbacks.lr_monitor import LearningRateMonitor
from callbacks.mlflow_logger import MLFlowLogger
from callbacks.model_checkpoint import ModelCheckpoint
from callbacks.model_summary import ModelSummary
from callbacks.progress import ProgressBar
from callbacks.throughput import ThroughputMonitor
from callbacks.wandb_logger import WandbLogger

__all__ = [
    "CSVLogger",
    "Callback",
    "EMA",
    "EarlyStopping",
    "LearningRateMonitor",
    "Logger",
    "MLFlowLogger",
    "ModelCheckpoint",
    "ModelSummary",
    "ProgressBar",
    "TensorBoardLogger",
    "ThroughputMonitor",
    "WandbLogger",
]
