"""brigade: data, model and pipeline parallel training for PyTorch, on CPU or GPU, one machine or many."""

from brigade.agent import launch
from brigade.config import OptimConfig, ParallelConfig, RunConfig, TrainConfig
from brigade.errors import BrigadeError
from brigade.pipeline.microbatch import unbatched
from brigade.pipeline.pipe import LocalPipeline, Pipeline
from brigade.train.trainer import Trainer

__version__ = "0.1.0"
__all__ = ["launch", "Trainer", "Pipeline", "LocalPipeline", "ParallelConfig", "OptimConfig",
           "TrainConfig", "RunConfig", "BrigadeError", "unbatched"]
