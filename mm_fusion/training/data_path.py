"""Step 2 of `scripts/train.py`: the data path chosen, once, from `--streaming` ([`load_training_data`])."""

from .arguments import DataArguments, ModelArguments
from .data import ARROW, TrainingData
from .streaming import STREAMING


def load_training_data(model_args: ModelArguments, data_args: DataArguments, training_args) -> TrainingData:
    """
    The pairs the arguments name, loaded and checked on the data path `--streaming` picks ([`DataPath`]): Arrow
    ([`load_arrow_data`]: columns and evaluation set checked, labels encoded) or streaming ([`load_streaming_data`]:
    the shards named, nothing read yet). The result keeps its path (`.path`), which the later steps follow.
    """
    path = STREAMING if data_args.streaming else ARROW
    return path.load(model_args, data_args, training_args)
