"""One-device sources: a single ``torch.save`` file whose every tensor is whole (held by rank 0).

Two kinds:

- a Lightning checkpoint of a one-device run (``trainer.save_checkpoint``): its tensors get the names a
  model-parallel run's DCP checkpoint gives them (``state_dict.<param>``, ``optimizer_<i>.state.<param>.<key>``),
  its optimizer param groups are carried as DCP carries them (``optimizer_<i>.param_groups.<g>.<key>``, ``params``
  as parameter names), and the rest (epoch, loops, callbacks, ...) travels as Lightning's ``meta.pt``;
- a plain state dict (``{name: tensor}``, nested dicts joined with dots); non-tensor leaves are carried.

The file is read without running code: its structure with ``torch.load(map_location="meta", weights_only=True)``
(no tensor data), tensor bytes as exact byte ranges like any other source, and the few non-tensor values by a
``weights_only=True``, ``mmap=True`` load (memory-mapped: tensor data is not read).

A Lightning checkpoint keys optimizer state by parameter index. The indices follow the optimizer's parameter order,
which for ``optimizer(self.parameters())`` is the module's parameter order: the state dict's entries minus its
buffers. Buffers are told apart by the roles of the source layout when given, else of the target layout (as
``lightning-sink layout`` writes them); every state tensor must have its parameter's shape.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
from pathlib import Path
from typing import Any, cast

import torch

from lightning_sink.checkpoint_format.dcp_folder import LIGHTNING_META_FILE
from lightning_sink.checkpoint_format.sink_section import drop_tensor_digests
from lightning_sink.error_text import reason_of
from lightning_sink.layout.io import load_layout
from lightning_sink.layout.schema import Chunk, Layout, MeshLayout, TensorLayout
from lightning_sink.reshard.carried_integrity import check_untensored_records
from lightning_sink.reshard.reader import (
    FileCache,
    ReadStats,
    TensorLocation,
    locate_tensors,
)
from lightning_sink.reshard.source import Source, check_same_tensors

__all__ = ["OneDeviceSource", "is_lightning_checkpoint", "is_lightning_file"]

_LIGHTNING_TENSOR_KEYS = ("state_dict", "optimizer_states")


def is_lightning_checkpoint(loaded: Any) -> bool:
    return (
        isinstance(loaded, dict)
        and "pytorch-lightning_version" in loaded
        and isinstance(loaded.get("state_dict"), dict)
    )


def is_lightning_file(path: Path) -> bool:
    """A Lightning checkpoint (read on the meta device: its structure only)."""
    fds = FileCache()
    try:
        loaded = locate_tensors(
            fds.fd(path), path, 0, os.path.getsize(path), f"checkpoint file {str(path)!r}", ReadStats()
        )
    finally:
        fds.close()
    return is_lightning_checkpoint(loaded)


class OneDeviceSource(Source):
    """A one-device checkpoint file as a one-rank source (see the module docstring)."""

    def __init__(self, path: Path, layout_file: Path | None, roles: Layout | None = None) -> None:
        self.path = path
        what = f"checkpoint file {str(path)!r}"
        fds = FileCache()
        try:
            loaded = locate_tensors(fds.fd(path), path, 0, os.path.getsize(path), what, ReadStats())
        finally:
            fds.close()
        declared = load_layout(layout_file) if layout_file is not None else None
        self.lightning = is_lightning_checkpoint(loaded)
        self.parameter_names: list[dict[int, str]] = []  # per optimizer: parameter index -> name
        if self.lightning:
            # is_lightning_checkpoint checked that it is a dict
            self.locations, paths, self.parameter_names = _lightning_tensors(
                cast(dict[Any, Any], loaded), declared or roles, what
            )
        else:
            if not isinstance(loaded, dict):
                raise ValueError(f"{what} holds a {type(loaded).__name__}, not a state dict")
            self.locations, paths = _plain_tensors(loaded, what)
        self.locations = {
            fqn: dataclasses.replace(location, what=f"tensor {fqn!r} in {what}")
            for fqn, location in self.locations.items()
        }
        layout = _whole_on_rank_0(self.locations, declared)
        if declared is not None:
            _check_declared(declared, layout, str(layout_file), what)
        stat = os.stat(path)
        fingerprint = hashlib.sha256(
            f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode() + layout.to_json().encode()
        ).hexdigest()
        super().__init__(what, layout, {0: path}, fingerprint, paths)
        # The values carried from this file are re-saved from its pickle (and any storages outside the tensors
        # copied): their records are checked here, the copied tensors' as they are read.
        offsets = {location.data_offset for location in self.locations.values()}
        self.verify_bytes_read += check_untensored_records(path, offsets, what)

    def locate(self, chunk: Chunk, fqn: str, stats: ReadStats, fds) -> TensorLocation:
        return self.locations[fqn]

    def _objects(self) -> dict:
        """The file's values, tensors memory-mapped (read only where a carried value holds one)."""
        try:
            return torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as error:
            raise ValueError(f"{self.description}: truncated or corrupt torch.save data: {reason_of(error)}") from None

    def non_tensor_state(self, stats: ReadStats) -> dict[str, bytes]:
        objects = self._objects()
        carried: dict[str, Any] = {}
        if self.lightning:
            for index, optimizer in enumerate(objects.get("optimizer_states") or []):
                for group_index, group in enumerate(optimizer.get("param_groups", [])):
                    for key, value in group.items():
                        if key == "params":
                            value = [self.parameter_names[index][p] for p in value]
                        carried[f"optimizer_{index}.param_groups.{group_index}.{key}"] = value
        else:
            carried = {fqn: value for fqn, value in _flatten(objects) if not isinstance(value, torch.Tensor)}
        return {fqn: _saved(value) for fqn, value in carried.items()}

    def extra_files(self) -> dict[str, bytes]:
        if not self.lightning:
            return {}
        objects = self._objects()
        meta = drop_tensor_digests({k: v for k, v in objects.items() if k not in _LIGHTNING_TENSOR_KEYS})
        return {LIGHTNING_META_FILE: _saved(meta)}  # (the .ckpt's tensor digests describe the .ckpt only)


def _saved(value: Any) -> bytes:
    """``torch.save`` bytes, as DCP stores a non-tensor leaf."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _flatten(node: Any, prefix: str = ""):
    """(dotted name, leaf) of nested dicts, as DCP flattens them."""
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{name}.")
        else:
            yield name, value


def _plain_tensors(loaded: dict, what: str):
    locations, paths = {}, {}
    for fqn, value in _flatten(loaded):
        if isinstance(value, TensorLocation):
            locations[fqn] = value
            paths[fqn] = fqn.split(".")
    if not locations:
        raise ValueError(f"{what} holds no tensors")
    return locations, paths


def _lightning_tensors(loaded: dict, roles: Layout | None, what: str):
    """The tensors of a Lightning checkpoint under DCP's names, and their nested paths."""
    locations: dict[str, TensorLocation] = {}
    paths: dict[str, list] = {}
    parameter_names: list[dict[int, str]] = []
    for name, value in loaded["state_dict"].items():
        if isinstance(value, TensorLocation):
            locations[f"state_dict.{name}"] = value
            paths[f"state_dict.{name}"] = ["state_dict", name]
    parameters = [name for name in loaded["state_dict"] if not _is_buffer(name, roles)]
    for index, optimizer in enumerate(loaded.get("optimizer_states") or []):
        order = [p for group in optimizer.get("param_groups", []) for p in group.get("params", [])]
        if len(order) != len(parameters):
            raise ValueError(
                f"{what}: optimizer {index} has {len(order)} parameters, the state dict {len(parameters)} (buffers told"
                " apart by the layout's roles): pass a src_strategy_file whose roles mark the buffers"
            )
        names = dict(zip(order, parameters))
        parameter_names.append(names)
        for param_index, state in (optimizer.get("state") or {}).items():
            if param_index not in names:
                raise ValueError(
                    f"{what}: optimizer {index} has state for parameter {param_index!r}, not in its groups"
                )
            parameter = names[param_index]
            for key, value in state.items():
                if not isinstance(value, TensorLocation):
                    continue
                shape = locations[f"state_dict.{parameter}"].shape
                if value.shape and value.shape != shape:
                    raise ValueError(
                        f"{what}: optimizer {index} state {key!r} of parameter {param_index} is {list(value.shape)},"
                        f" but the parameter it maps to ({parameter!r}) is {list(shape)}: the optimizer's parameter"
                        " order is not the state dict's"
                    )
                fqn = f"optimizer_{index}.state.{parameter}.{key}"
                locations[fqn] = value
                paths[fqn] = [f"optimizer_{index}", "state", parameter, key]
    for index, optimizer in enumerate(loaded.get("optimizer_states") or []):  # carried values' paths, as DCP's
        for group_index, group in enumerate(optimizer.get("param_groups", [])):
            for key in group:
                paths[f"optimizer_{index}.param_groups.{group_index}.{key}"] = [
                    f"optimizer_{index}",
                    "param_groups",
                    group_index,
                    key,
                ]
    return locations, paths, parameter_names


def _is_buffer(name: str, roles: Layout | None) -> bool:
    tensor = roles.tensors.get(f"state_dict.{name}") if roles is not None else None
    return tensor is not None and tensor.role == "buffer"


def _whole_on_rank_0(locations: dict[str, TensorLocation], declared: Layout | None) -> Layout:
    tensors = {}
    for fqn, location in locations.items():
        role = (
            declared.tensors[fqn].role
            if declared is not None and fqn in declared.tensors
            else ("optimizer_state" if fqn.startswith("optimizer") else "parameter")
        )
        tensors[fqn] = TensorLayout(
            role=role,
            global_shape=location.shape,
            dtype=str(location.dtype).removeprefix("torch."),
            placements=("Replicate()",),
            chunks=(Chunk(0, (0,) * len(location.shape), location.shape),),
        )
    return Layout(world_size=1, mesh=MeshLayout.one_dimensional(1), tensors=tensors)


def _check_declared(declared: Layout, found: Layout, layout_name: str, what: str) -> None:
    where = f"layout file {layout_name!r} does not match {what}"
    if declared.world_size != 1:
        raise ValueError(f"{where}: a one-device checkpoint has world size 1, the layout {declared.world_size}")
    check_same_tensors(declared, found, where, "file")
