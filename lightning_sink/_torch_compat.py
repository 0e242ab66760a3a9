"""Every private torch API the package uses, in one place (as ``_lightning_compat`` for Lightning).

Each name here is guarded by ``tests/test_torch_compat.py``: a torch upgrade that moves or changes one fails there,
naming it, instead of deep inside a conversion or a checkpoint load.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as functional_collectives
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "inductor_cache_counts",
    "inductor_cache_folder",
    "StridedShard",
    "MetadataCheckedReader",
    "WeightsOnlyLoadPlanner",
    "compute_local_shape_and_global_offset",
    "inductor_option_names",
    "backend_compiler",
    "graph_output_examples",
    "called_as",
    "init_fake_process_group",
    "flatten_state_dict",
    "set_element",
    "batch_reading_iterator",
    "read_batches_with",
    "restore_batch_reads",
    "hooks_a_functional_step_would_skip",
    "note_optimizer_step",
    "RecompiledFunction",
    "recompiled_functions",
    "recompile_limit",
    "user_function_name",
    "storage_offset_in_file",
    "compiled_graph_count",
    "traced_all_reduce_sum",
    "scan_loop",
    "tree_map",
    "random_draws_counted",
    "fsdp_params",
    "fsdp_partial_sum",
    "fsdp_unsharded_param",
    "set_fsdp_partial_sum",
]

StridedShard = _StridedShard  # FSDP2 + TP's row placement of a parameter sharded twice on one dim
compute_local_shape_and_global_offset = _compute_local_shape_and_global_offset  # DTensor's own chunk rule


class _BatchReadingIterator(_SingleProcessDataLoaderIter):
    """A single-process ``DataLoader`` iterator that reads each batch as ``read(indices)``; everything else (the
    sampler, the base-seed draw, the yield counter, the profiler's record) is the loader's own iterator."""

    def __init__(self, loader: DataLoader, read: Callable[[Any], Any]) -> None:
        super().__init__(loader)
        self._read = read

    def _next_data(self) -> Any:
        return self._read(self._next_index())

    def __next__(self) -> Any:
        if self._sampler_iter is None or torch.autograd._profiler_enabled():
            return super().__next__()
        # The loader's own __next__ for a map-style dataset (the only kind read this way) without its profiling
        # scope when no profiler is on to record it: opening and closing that scope is a large share of reading a
        # small batch by indexing, and the sampler, the yield counter and the batch are the same.
        data = self._next_data()
        self._num_yielded += 1
        return data


def batch_reading_iterator(loader: DataLoader, read: Callable[[Any], Any]) -> Iterator[Any]:
    """One pass over the single-process ``loader``: its own iterator, each batch read as ``read(indices)``."""
    return _BatchReadingIterator(loader, read)


def _start_pass(loader: DataLoader, reader_for: Callable[[DataLoader], Callable[[Any], Any] | None]) -> Any:
    read = reader_for(loader)
    if read is None:  # the loader no longer reads that way (its collate_fn was replaced): its own iterator
        return DataLoader._get_iterator(loader)
    return batch_reading_iterator(loader, read)


def read_batches_with(loader: DataLoader, reader_for: Callable[[DataLoader], Callable[[Any], Any] | None]) -> bool:
    """Every later pass over ``loader`` (a single-process ``DataLoader``) reads its batches with the function
    ``reader_for(loader)`` returns at the pass's start (``None``: the loader's own reads), until
    ``restore_batch_reads``. ``iter(loader)`` calls ``loader._get_iterator()``; an attribute of that name on the
    loader object shadows the method. Returns False, changing nothing, where such an attribute is already there."""
    if "_get_iterator" in vars(loader):
        return False
    vars(loader)["_get_iterator"] = functools.partial(_start_pass, loader, reader_for)
    return True


def restore_batch_reads(loader: DataLoader) -> None:
    """Undo ``read_batches_with``: the loader's own ``_get_iterator`` again."""
    loader.__dict__.pop("_get_iterator", None)


def init_fake_process_group(world_size: int) -> None:
    """A default process group of ``world_size`` ranks, this one rank 0, with no peers: collectives return at once
    and produce nothing. Built from torch's C++ fake process group, registered as torch's own test utility does,
    without importing ``torch.testing``."""
    from torch._C._distributed_c10d import FakeProcessGroup, FakeStore

    def create(common_options: Any, backend_options: Any) -> Any:
        # torch's stub for _create_internal lacks the options argument its C++ binding takes
        return FakeProcessGroup._create_internal(  # type: ignore[call-arg]
            common_options.group_rank, common_options.group_size, backend_options
        )

    dist.Backend.register_backend(dist.Backend.FAKE, create, extended_api=True, devices=["cpu", "cuda"])
    dist.init_process_group(dist.Backend.FAKE, rank=0, world_size=world_size, store=FakeStore())


class MetadataCheckedReader(FileSystemReader):
    """DCP's file-system reader with ``.metadata`` read by ``read_metadata_file`` (this package's restricted
    unpickler) instead of DCP's plain ``pickle.load``, which would run any code the file names."""

    def __init__(self, path: str | Path, read_metadata_file: Callable[[Path], Metadata]) -> None:
        super().__init__(path)
        self._read_metadata_file = read_metadata_file

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._read_metadata_file(Path(self.path))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        metadata.storage_meta = storage_meta
        storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata does after its unpickling
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are loaded with ``weights_only=True``
    (``DefaultLoadPlanner.load_bytes`` passes ``weights_only=False``)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, map_location="cpu", weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def hooks_a_functional_step_would_skip(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The backward and optimizer-step hooks registered on ``module`` (and its submodules), its parameters,
    ``optimizer`` or globally: a compiled step computes gradients with ``torch.func`` and updates parameters
    functionally, so none of them would run. torch has no public reader of registered hooks."""
    from torch.nn.modules import module as module_file
    from torch.optim import optimizer as optimizer_file

    found = []
    for name, submodule in module.named_modules():
        if submodule._backward_hooks or submodule._backward_pre_hooks:
            found.append(f"a backward hook on module {name or type(module).__name__!r}")
    for name, param in module.named_parameters():
        if param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None):
            found.append(f"a gradient hook on parameter {name!r}")
    if module_file._global_backward_hooks or module_file._global_backward_pre_hooks:
        found.append("a global module backward hook")
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        found.append(f"a step hook on the {type(optimizer).__name__} optimizer")
    if optimizer_file._global_optimizer_pre_hooks or optimizer_file._global_optimizer_post_hooks:
        found.append("a global optimizer step hook")
    return found


def note_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Tell LR schedulers that ``optimizer`` has stepped, as its wrapped ``step`` would (a compiled update program
    updates the parameters without calling it); otherwise a scheduler warns that it stepped before the optimizer."""
    optimizer.__dict__["_opt_called"] = True  # the flag its wrapped step sets (torch.optim.lr_scheduler reads it)


@dataclass(frozen=True)
class RecompiledFunction:
    """A function TorchDynamo has compiled more than once in this process."""

    code: CodeType
    versions: int  # compiled versions it holds now (TorchDynamo stops compiling it at ``recompile_limit()``)
    last_guard_failure: str  # a guard that failed at the latest recompile, as TorchDynamo words it, and its source


def recompiled_functions() -> list[RecompiledFunction]:
    """Every function TorchDynamo recompiled in this process, from its own records: the guard failures it notes
    at each recompile (kept whether or not ``TORCH_LOGS="recompiles"`` is on) and each function's compiled
    versions (its cache entries). Call only once ``torch._dynamo`` is loaded (``torch.compile`` loads it)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import guard_failures

    found = []
    for code, reasons in list(guard_failures.items()):
        if not isinstance(code, CodeType) or not reasons:
            continue
        # "<frame>/<version>: <guard>  # <source line>  # <file:line> in <function>", then the user's stack
        reason = str(reasons[-1]).split("\n", 1)[0].split(": ", 1)[-1]
        guard, *source = [" ".join(part.split()) for part in reason.split(" # ")]
        if source and source[0]:
            guard = f"{guard} (from: {source[0]})"
        found.append(RecompiledFunction(code, len(_debug_get_cache_entry_list(code)), guard))
    return found


def recompile_limit() -> int:
    """How many versions of one function TorchDynamo compiles before it runs the function eagerly for good."""
    import torch._dynamo

    return int(torch._dynamo.config.recompile_limit)


def user_function_name(code: CodeType) -> str:
    """The user's name for a function TorchDynamo compiled: the part of a function after a graph break is compiled
    as a resume function that TorchDynamo names ``torch_dynamo_resume_in_<function>_at_<line>``."""
    prefix = "torch_dynamo_resume_in_"
    if not code.co_name.startswith(prefix) or "_at_" not in code.co_name:
        return code.co_name
    function, line = code.co_name[len(prefix) :].rsplit("_at_", 1)
    return f"{function} (its part after the graph break at line {line})"


def storage_offset_in_file(storage: torch.UntypedStorage) -> int | None:
    """Where a storage's raw bytes start in the file ``torch.load`` read it from (``None``: not read from a file).
    torch records it on every storage it loads from a zip file (``_checkpoint_offset``) and has no public reader."""
    offset = getattr(storage, "_checkpoint_offset", None)
    return None if offset is None else int(offset)


def compiled_graph_count() -> int:
    """How many graphs TorchDynamo has compiled in this process so far (a recompilation adds one): torch's own
    counter, which has no public reader."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def inductor_cache_folder() -> Path:
    """The folder of Inductor's on-disk caches: ``TORCHINDUCTOR_CACHE_DIR``, else torch's default (a private
    function; torch's public ``cache_dir`` would also create the folder and set the variable)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()).absolute()


def inductor_cache_counts() -> tuple[int, int]:
    """How many graphs Inductor has taken from its on-disk cache of compiled graphs in this process so far, and how
    many it compiled and stored there (hits, misses): torch's own counters, which have no public reader."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("fxgraph_cache_hit", 0)), int(counters["inductor"].get("fxgraph_cache_miss", 0))


def traced_all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` summed over ``group``'s ranks, out of place, as an operation ``torch.compile`` traces into its
    graph (a functional collective: torch's public ``dist.all_reduce`` works in place on the process group and
    breaks the graph). Meant for compiled programs: run eagerly, it waits for the sum at once."""
    return functional_collectives.all_reduce(tensor, "sum", group)


def tree_map(function: Callable[..., Any], tree: Any, *others: Any) -> Any:
    """torch's pytree ``tree_map``: ``function`` over the leaves of ``tree`` (and the same leaves of ``others``),
    the containers rebuilt as they were."""
    from torch.utils._pytree import tree_map as torch_tree_map

    return torch_tree_map(function, tree, *others)


def scan_loop(body: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any) -> tuple[Any, Any]:
    """torch's ``scan`` higher-order operator: ``body(carry, x)`` over the leading dimension of ``xs``, traced once
    and compiled as one loop; (the last carry, the stacked per-step outputs)."""
    from torch._higher_order_ops.scan import scan

    return scan(body, init, xs)


@dataclass
class RandomDraws:
    """The random operators run while ``random_draws_counted`` was active."""

    count: int = 0


@contextlib.contextmanager
def random_draws_counted() -> Iterator[RandomDraws]:
    """Count the random operators (ATen's ``nondeterministic_seeded`` ones: dropout's, ``rand``...) run inside the
    block, under torch's dispatch mode (which sees the operators a module's forward and backward reach)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    draws = RandomDraws()

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if torch.Tag.nondeterministic_seeded in func.tags:
                draws.count += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        yield draws


def inductor_option_names() -> frozenset[str]:
    """The settings ``torch.compile(options=...)`` accepts for Inductor here: names of Inductor's configuration
    (``torch._inductor.config``), which a torch release may rename or drop; torch.compile refuses an unknown one."""
    import torch._inductor

    return frozenset(torch._inductor.list_options())


def backend_compiler(backend: str, options: dict[str, Any] | None) -> Callable[[torch.fx.GraphModule, list], Any]:
    """``torch.compile``'s backend ``backend`` as the function of (graph, example inputs) that TorchDynamo calls, with
    Inductor's ``options`` applied as ``torch.compile(backend="inductor", options=options)`` applies them (a backend
    other than Inductor takes no options)."""
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return functools.partial(compile_fx, config_patches=dict(options or {}))
    if options:
        raise ValueError(f"options={options!r} are Inductor's: backend={backend!r} takes none")
    from torch._dynamo import lookup_backend

    return lookup_backend(backend)


def graph_output_examples(graph: torch.fx.GraphModule) -> list[Any]:
    """The values TorchDynamo recorded for its graph's outputs while tracing (fake tensors: shape, stride, dtype,
    device), in the order the graph returns them."""
    output = next(node for node in graph.graph.nodes if node.op == "output")
    returned = output.args[0]
    nodes = returned if isinstance(returned, (tuple, list)) else (returned,)
    return [node.meta.get("example_value") if isinstance(node, torch.fx.Node) else node for node in nodes]


def called_as(compiled: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapper`` of a backend's compiled function, marked to be called as TorchDynamo calls ``compiled``: with one
    list of inputs where the backend made it "boxed" (torch's private ``_boxed_call`` flag), else with the inputs."""
    if getattr(compiled, "_boxed_call", False):
        wrapper.__dict__["_boxed_call"] = True
    return wrapper


# FSDP2 keeps a window's partial sums where no public API reaches them. The four functions below are the only places
# that touch its internals; tests/strategies/test_fsdp_window.py fails loudly when torch moves them.
def fsdp_params(modules: list[FSDPModule]) -> list[Any]:
    """The ``FSDPParam`` objects of ``modules`` (FSDP2's per-parameter state), in order."""
    return [
        fsdp_param
        for module in modules
        for group in module._get_fsdp_state()._fsdp_param_groups
        for fsdp_param in group.fsdp_params
    ]


def fsdp_unsharded_param(fsdp_param: Any) -> torch.Tensor:
    """The unsharded parameter whose ``.grad`` FSDP2 accumulates into with gradient sync off."""
    return fsdp_param._unsharded_param


def fsdp_partial_sum(fsdp_param: Any) -> torch.Tensor | None:
    """The unreduced gradient sum: in ``reduce_dtype`` when that differs from the parameter's dtype."""
    if fsdp_param.unsharded_accumulated_grad is not None:
        return fsdp_param.unsharded_accumulated_grad
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return None if unsharded is None else unsharded.grad


def set_fsdp_partial_sum(fsdp_param: Any, grad: torch.Tensor | None) -> None:
    """Put ``grad`` back where ``fsdp_partial_sum`` reads it: the accumulated gradient when its dtype differs from the
    parameter's, else the unsharded parameter's ``.grad``."""
    unsharded = fsdp_param._unsharded_param
    if grad is not None and grad.dtype != unsharded.dtype:
        fsdp_param.unsharded_accumulated_grad, unsharded.grad = grad, None
    else:
        fsdp_param.unsharded_accumulated_grad, unsharded.grad = None, grad
