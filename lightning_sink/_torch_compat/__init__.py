"""Every private torch API the package uses, in one package (as ``_lightning_compat`` for Lightning).

Each name here is guarded by ``tests/test_torch_compat.py``: a torch upgrade that moves or changes one fails there,
naming it, instead of deep inside a conversion or a checkpoint load. The package's modules import these names from
here; the submodules hold them by concept: ``data_loading`` (the indexed reads), ``checkpoints`` (DCP and DTensor),
``distributed`` (process groups, the traced all-reduce, FSDP2's window state) and ``compile`` (torch.compile,
TorchDynamo and Inductor).
"""

from __future__ import annotations

from lightning_sink._torch_compat.checkpoints import (
    MetadataCheckedReader,
    StridedShard,
    WeightsOnlyLoadPlanner,
    compute_local_shape_and_global_offset,
    flatten_state_dict,
    set_element,
    storage_offset_in_file,
)
from lightning_sink._torch_compat.compile import (
    RecompiledFunction,
    backend_compiler,
    cached_loops_option,
    called_as,
    compiled_graph_count,
    graph_output_examples,
    hooks_a_functional_step_would_skip,
    inductor_cache_counts,
    inductor_cache_folder,
    inductor_option_names,
    let_loops_order_random_draws,
    may_vary_in_size,
    note_optimizer_step,
    recompile_limit,
    recompiled_functions,
    scan_loop,
    tree_map,
    user_function_name,
)
from lightning_sink._torch_compat.data_loading import batch_reading_iterator, read_batches_with, restore_batch_reads
from lightning_sink._torch_compat.distributed import (
    fsdp_params,
    fsdp_partial_sum,
    fsdp_unsharded_param,
    init_fake_process_group,
    set_fsdp_partial_sum,
    traced_all_reduce_sum,
)

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
    "let_loops_order_random_draws",
    "cached_loops_option",
    "may_vary_in_size",
    "fsdp_params",
    "fsdp_partial_sum",
    "fsdp_unsharded_param",
    "set_fsdp_partial_sum",
]
