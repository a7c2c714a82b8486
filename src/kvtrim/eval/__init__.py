"""Evaluation data: synthetic long-context tasks, LongBench v1, haystacks and metrics."""

from __future__ import annotations

from kvtrim.eval.haystacks import fetch_haystack, get_haystack, haystack_info, split_sentences
from kvtrim.eval.longbench import LONGBENCH_DATASETS, load_longbench, truncate_middle
from kvtrim.eval.metrics import METRICS, aggregate, metric_versions, score_sample
from kvtrim.eval.tasks import RULER_TASKS, TASKS, Sample, TaskSpec, generate_task, list_tasks, needle_grid

__all__ = [
    "LONGBENCH_DATASETS",
    "METRICS",
    "RULER_TASKS",
    "TASKS",
    "Sample",
    "TaskSpec",
    "aggregate",
    "fetch_haystack",
    "generate_task",
    "get_haystack",
    "haystack_info",
    "list_tasks",
    "load_longbench",
    "metric_versions",
    "needle_grid",
    "score_sample",
    "split_sentences",
    "truncate_middle",
]
