"""Pipeline parallelism: stage partitioning, point-to-point exchange and microbatch schedules.

See :mod:`mg_parallel.pipeline.schedules` for the schedule contract and
:mod:`mg_parallel.pipeline.timetable` for why the schedules cannot deadlock.
"""

from mg_parallel.pipeline.grads import (
    allreduce_pipeline_replicated_grads,
    allreduce_shared_embedding_grads,
    average_losses,
)
from mg_parallel.pipeline.partition import partition_layers
from mg_parallel.pipeline.recorder import Recorder, ScheduleEvent, ScheduleRecorder
from mg_parallel.pipeline.schedules import (
    ForwardStep,
    finalize_model_grads,
    forward_backward_1f1b,
    forward_backward_interleaved,
    forward_backward_no_pipelining,
    get_forward_backward_func,
)
from mg_parallel.pipeline.timetable import pipeline_plan, stage_order

__all__ = [
    "ForwardStep",
    "Recorder",
    "ScheduleEvent",
    "ScheduleRecorder",
    "allreduce_pipeline_replicated_grads",
    "allreduce_shared_embedding_grads",
    "average_losses",
    "finalize_model_grads",
    "forward_backward_1f1b",
    "forward_backward_interleaved",
    "forward_backward_no_pipelining",
    "get_forward_backward_func",
    "partition_layers",
    "pipeline_plan",
    "stage_order",
]
