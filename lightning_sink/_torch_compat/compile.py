"""torch.compile's, TorchDynamo's and Inductor's internals the compiled programs rely on (their build, their loop,
their caches and recompiles), and the optimizer and hook state a functional step must respect."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Any

import torch

__all__ = [
    "inductor_cache_counts",
    "inductor_cache_folder",
    "inductor_option_names",
    "backend_compiler",
    "graph_output_examples",
    "called_as",
    "hooks_a_functional_step_would_skip",
    "module_hook_counts",
    "note_optimizer_step",
    "RecompiledFunction",
    "recompiled_functions",
    "most_recompiled",
    "recompile_limit",
    "user_function_name",
    "compiled_graph_count",
    "scan_loop",
    "tree_map",
    "let_loops_order_random_draws",
    "cached_loops_option",
    "may_vary_in_size",
]


def module_hook_counts(module: torch.nn.Module) -> tuple[int, ...]:
    """How many hooks of each kind ``module``, its submodules and parameters hold, and the global module hooks: a
    compiled program traced the hooks there were when it was built (a pruning callback adds a forward pre-hook).
    torch has no public reader of registered hooks."""
    from torch.nn.modules import module as module_file

    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
    counts = [len(getattr(submodule, kind, ())) for _, submodule in module.named_modules() for kind in kinds]
    counts += [len(param._backward_hooks or ()) for param in module.parameters()]
    globals_ = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_hooks")
    return (*counts, *(len(getattr(module_file, name, ())) for name in globals_))


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


def most_recompiled(codes: Iterable[CodeType]) -> RecompiledFunction | None:
    """Of the functions with these code objects, the one TorchDynamo holds the most compiled versions of, where it
    recompiled any (``recompiled_functions``)."""
    wanted = set(codes)
    found = [function for function in recompiled_functions() if function.code in wanted]
    return max(found, key=lambda function: function.versions, default=None)


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


def let_loops_order_random_draws() -> None:
    """Let a loop (torch's ``scan``, compiled by Inductor) hold random operators kept in eager's order.

    With ``fallback_random`` Inductor chains the second and later random operators of a graph to the one before with
    its ``control_deps`` operator, so that they draw from torch's generator in eager's order. Lowering ``scan`` to a
    loop traces the loop's body again, and that tracing (``make_fx``'s proxy mode) has no rule for ``control_deps``:
    a loop over a step with two dropouts did not build. The rule added here records the operator as it stands (its
    operation's subgraph registered on the traced module), as torch records its other higher-order operators. Once
    per process; nothing where torch has no such operator or already has the rule."""
    try:
        from torch._inductor.fx_passes.control_dependencies import control_deps
    except ImportError:
        return  # (no such operator: nothing chains the draws)
    from torch.fx.experimental.proxy_tensor import (
        ProxyTorchDispatchMode,
        disable_proxy_modes_tracing,
        track_tensor_tree,
    )
    from torch.utils._pytree import tree_map as torch_tree_map

    if ProxyTorchDispatchMode in control_deps.python_key_table:
        return

    @control_deps.py_impl(ProxyTorchDispatchMode)
    def traced(mode: Any, additional_deps: Any, subgraph: Any, *args: Any, **kwargs: Any) -> Any:
        with disable_proxy_modes_tracing():
            out = control_deps(additional_deps, subgraph, *args, **kwargs)
        mode.tracer.root.register_module(mode.tracer.get_fresh_qualname("control_deps_subgraph"), subgraph)
        unwrap = mode.tracer.unwrap_proxy
        proxy = mode.tracer.create_proxy(
            "call_function",
            control_deps,
            (torch_tree_map(unwrap, tuple(additional_deps)), unwrap(subgraph), *torch_tree_map(unwrap, args)),
            torch_tree_map(unwrap, kwargs),
        )
        return track_tensor_tree(out, proxy, constant=None, tracer=mode.tracer)


def cached_loops_option() -> dict[str, Any]:
    """The Inductor setting that lets its on-disk caches keep a graph holding torch's ``scan`` (a loop over windows).

    Inductor's cache of compiled graphs and AOTAutograd's refuse a graph with a higher-order operator not marked
    cacheable, and ``scan`` is not: every fit built its loops from scratch, cached or not. The cache key of such a
    graph holds the loop's body (its subgraph's code is hashed with the graph), which keeps one loop apart from
    another; so ``scan`` is marked cacheable through Inductor's ``unsafe_marked_cacheable_functions``, keyed by the
    torch version."""
    from torch._higher_order_ops.scan import scan_op

    return {"unsafe_marked_cacheable_functions": {f"{scan_op.__module__}.{scan_op.__name__}": torch.__version__}}


def may_vary_in_size(tensor: torch.Tensor, dim: int) -> None:
    """Tell TorchDynamo that ``tensor``'s size along ``dim`` may differ between calls, so that it traces that size
    as a symbol rather than a constant (one graph for every size, where nothing in the graph fixes it; sizes 0 and 1
    still get graphs of their own). A mark on the tensor object, read at its next compiled call."""
    import torch._dynamo

    torch._dynamo.maybe_mark_dynamic(tensor, dim)
