"""Small-scale pretraining with attention variants (softmax, softmax1, biases, gates...).

Train :class:`MassiveLM` models under identical budgets and compare their massive
activations, attention sinks and int8 cost. See ``docs/training.md``.

>>> sorted(PRESETS)
['cpu', 'gpu-gpt2', 'gpu-small', 'smoke']
"""

from massive_lens.train.compare import Comparison, compare_main, compare_variants
from massive_lens.train.hf_attention import swap_attention
from massive_lens.train.layers import MassiveLMConfig
from massive_lens.train.model import MassiveLM
from massive_lens.train.offswitch_runs import offswitch_task_runs, where_table
from massive_lens.train.presets import PRESETS, TrainConfig, get_preset
from massive_lens.train.retrofit import Retrofit, retrofit
from massive_lens.train.stability import TrainingStability, find_spikes, training_stability
from massive_lens.train.taskgrid import grid_settings, run_grid
from massive_lens.train.taskpage import task_answer
from massive_lens.train.taskrecord import run_folder
from massive_lens.train.taskrun import TaskRun, train_task
from massive_lens.train.tasks import TASKS, make_task
from massive_lens.train.tasksettings import TaskSettings
from massive_lens.train.trainer import TrainRun, load_run, train_model
from massive_lens.train.variants import VARIANTS, VariantConfig

__all__ = [
    "VARIANTS", "VariantConfig", "MassiveLM", "MassiveLMConfig", "TrainConfig", "PRESETS",
    "get_preset", "train_model", "load_run", "TrainRun", "compare_variants", "compare_main",
    "Comparison", "retrofit", "Retrofit", "swap_attention", "training_stability", "TrainingStability", "find_spikes",
    "TASKS", "make_task", "TaskSettings", "TaskRun", "train_task", "grid_settings", "run_grid", "run_folder",
    "task_answer", "offswitch_task_runs", "where_table",
]
