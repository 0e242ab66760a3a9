"""The torchmetrics attributes Lightning reads when a ``Metric`` or ``MetricCollection`` is logged."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def metric_step_value(metric: Any) -> Any:
    """What Lightning writes as a logged torchmetrics ``Metric``'s step value: the result of the metric's latest
    forward call (the ``_forward_cache`` Lightning's result collection reads; None before any)."""
    return metric._forward_cache


@contextmanager
def metric_step_value_set_to(metric: Any, value: Any) -> Iterator[None]:
    """The Metric's step value, as Lightning reads it when it is logged, set to ``value`` for the block."""
    saved = metric._forward_cache
    metric._forward_cache = value
    try:
        yield
    finally:
        metric._forward_cache = saved


# The MetricCollection method that makes the members of a compute group share (or copy) the group's state; its
# public readers (``items``, ``values``, ``collection[key]``) call it and set a flag on the collection as they read.
COLLECTION_STATE_SHARING = "_compute_groups_create_state_ref"


def logged_collection_items(collection: Any) -> list[tuple[str, Any]]:
    """What ``LightningModule.log_dict(collection)`` logs for a torchmetrics ``MetricCollection``: its entries under
    their prefixed names, read with Lightning's own arguments (with compute groups, the members share their group's
    state by reference rather than by copy, which ``items`` sets up as it is read)."""
    options: dict[str, bool] = {"keep_base": False}
    if collection._enable_compute_groups:
        options["copy_state"] = False
    return list(collection.items(**options))
