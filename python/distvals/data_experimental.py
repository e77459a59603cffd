"""``distvals.data.experimental``: the names TensorFlow programs reach as
``tf.data.experimental.*``, so that ``tf.data`` can become ``dv.data`` in such code too.
The functions that tf.data has as dataset transformations return a function for
``Dataset.apply`` (``ds.apply(unique())``), as there."""

from __future__ import annotations

import typing
from typing import Any, Callable

import numpy as np

from . import data_transforms
from .data import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    AutoShardPolicy,
    AutotuneOptions,
    Dataset,
    DistributeOptions,
    ExternalStatePolicy,
    OptimizationOptions,
    Optional,
    ThreadingOptions,
)

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "AutoShardPolicy",
    "AutotuneOptions",
    "Counter",
    "DistributeOptions",
    "ExternalStatePolicy",
    "OptimizationOptions",
    "Optional",
    "ThreadingOptions",
    "assert_cardinality",
    "cardinality",
    "choose_from_datasets",
    "enumerate_dataset",
    "get_single_element",
    "ignore_errors",
    "sample_from_datasets",
    "scan",
    "unique",
]

Transformation = Callable[[Dataset], Dataset]


def cardinality(dataset: Dataset) -> np.int64:
    """``dataset.cardinality()``."""
    return dataset.cardinality()


def get_single_element(dataset: Dataset) -> Any:
    """``dataset.get_single_element()``."""
    return dataset.get_single_element()


def Counter(start: int = 0, step: int = 1, dtype: Any = np.int64) -> Dataset:
    """``Dataset.counter(start, step, dtype)``."""
    return Dataset.counter(start, step, dtype)


def choose_from_datasets(datasets: Any, choice_dataset: Dataset, stop_on_empty_dataset: bool = True) -> Dataset:
    """``Dataset.choose_from_datasets``."""
    return Dataset.choose_from_datasets(datasets, choice_dataset, stop_on_empty_dataset)


def sample_from_datasets(
    datasets: Any,
    weights: Any = None,
    seed: typing.Optional[int] = None,
    stop_on_empty_dataset: bool = False,
    rerandomize_each_iteration: typing.Optional[bool] = None,
) -> Dataset:
    """``Dataset.sample_from_datasets``."""
    return Dataset.sample_from_datasets(datasets, weights, seed, stop_on_empty_dataset, rerandomize_each_iteration)


def assert_cardinality(expected_cardinality: int) -> Transformation:
    """For ``apply``: this dataset, with ``cardinality()`` ``expected_cardinality``; a pass
    that finds another number of elements raises ``distvals.data.CardinalityError`` (a
    ``RuntimeError``; tf.data's FailedPreconditionError), with tf.data's message."""
    return lambda dataset: data_transforms.assert_cardinality(dataset, expected_cardinality, None)


def enumerate_dataset(start: int = 0) -> Transformation:
    """For ``apply``: ``Dataset.enumerate(start)``."""
    return lambda dataset: dataset.enumerate(start)


def ignore_errors(log_warning: bool = False) -> Transformation:
    """For ``apply``: ``Dataset.ignore_errors(log_warning)``."""
    return lambda dataset: dataset.ignore_errors(log_warning)


def scan(initial_state: Any, scan_func: Callable[[Any, Any], Any]) -> Transformation:
    """For ``apply``: ``Dataset.scan(initial_state, scan_func)``."""
    return lambda dataset: dataset.scan(initial_state, scan_func)


def unique() -> Transformation:
    """For ``apply``: ``Dataset.unique()``."""
    return lambda dataset: dataset.unique()
