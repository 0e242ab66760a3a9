"""How a step program is compiled: ``torch.compile`` over the whole program, one graph, with Inductor's settings
for the device (``inductor_options``), each program with a code object of its own (``compiled``); one
``StepPrograms``' five compiled programs (``CompiledPrograms``); and, for programs with a sum across processes
traced in, a backend that builds them without running them (``BuildWithoutRunning``)."""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType
from typing import Any

import torch

from lightning_sink._torch_compat import (
    backend_compiler,
    cached_loops_option,
    called_as,
    graph_output_examples,
    inductor_option_names,
    let_loops_order_random_draws,
    may_vary_in_size,
    tree_map,
)
from lightning_sink.compiled.forward_compile import RANDOM_AS_EAGER
from lightning_sink.compiled.saved_loop import SavedLoop, saved_loops_on
from lightning_sink.compiled.traced_programs import TracedPrograms

__all__ = ["BuildWithoutRunning", "CompiledPrograms", "compile_options", "compiled", "inductor_options"]

# why: ``inductor_options``; RANDOM_AS_EAGER: eager's random numbers (forward_compile.py)
_CPU_INDUCTOR_OPTIONS = {
    "layout_optimization": False,
    "cpp_wrapper": True,
    "emulate_precision_casts": True,
    **RANDOM_AS_EAGER,
}
_PROGRAM_NUMBERS = itertools.count()


def inductor_options(device: torch.device) -> dict[str, Any] | None:
    """Inductor's settings for programs on ``device`` (None: its defaults).

    On a CPU: ``layout_optimization`` off, so the programs keep the layouts the module's tensors have, as eager does.
    Inductor otherwise lays every convolution's tensors out channels-last on a CPU; for the small convolutions of a
    net trained on a CPU oneDNN's kernels in the tensors' own layout are faster, and the conversions between the two
    layouts cost again (LeNet-5's pooling backward became a scatter into a channels-last copy), which made the
    compiled step slower than eager's.
    ``cpp_wrapper``: the generated kernels and ATen's (the convolutions, the matrix products) called from generated
    C++ instead of Python, so a program's call costs one Python call rather than one per kernel.
    ``emulate_precision_casts``: under a bf16 or fp16 autocast, each fused operation's result is rounded to that
    dtype as eager rounds it between its kernels (Inductor otherwise keeps fp32 between fused operations: a step of
    LayerNorm and GELU trained about 2e-4 away from eager's in a few hundred steps).
    ``fallback_random``: random operators (dropout) call eager's, so a program draws the numbers eager draws from
    the same seed (``forward_compile.py``).
    ``unsafe_marked_cacheable_functions`` (``cached_loops_option``): a loop over windows kept in Inductor's on-disk
    caches like any other program, so a second fit of the same module reads it instead of building it again.
    Elsewhere (CUDA) Inductor's defaults, with which the GPU figures of benchmarks/README.md were measured.
    """
    if device.type != "cpu":
        return None
    known = inductor_option_names()  # a setting this torch no longer has is left out, not an error at every build
    options = {**_CPU_INDUCTOR_OPTIONS, **cached_loops_option()}
    return {name: value for name, value in options.items() if name in known}


def compile_options(backend: str, device: torch.device) -> dict[str, Any] | None:
    """The compiler's settings for ``backend`` on ``device``: Inductor's from ``inductor_options``, else none."""
    return inductor_options(device) if backend == "inductor" else None


def _own_code(method: Any) -> Callable[..., Any]:
    """``method`` with a code object of its own: torch.compile keeps its compiled variants (and their limit) per
    code object, so each programs object gets its own instead of sharing, and filling, one cache with every other."""
    function = method.__func__
    code = function.__code__.replace(co_name=f"{function.__name__}_{next(_PROGRAM_NUMBERS)}")
    copy = types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)
    return types.MethodType(copy, method.__self__)


def compiled(
    program: Any,
    backend: str | BuildWithoutRunning,
    options: dict[str, Any] | None,
    codes: list[CodeType] | None = None,
) -> Callable[..., Any]:
    """``program`` (a bound method) compiled as one whole graph, for the shapes of its first call (``options``:
    Inductor's, for ``backend="inductor"``; a ``BuildWithoutRunning`` holds its own); its own code object added to
    ``codes``."""
    own = _own_code(program)
    if codes is not None:
        codes.append(own.__code__)
    return torch.compile(own, fullgraph=True, backend=backend, dynamic=False, options=options)


class BuildWithoutRunning:
    """A ``torch.compile`` backend (``backend`` with ``options``) whose programs compile without running while
    ``building()`` is on: such a call compiles its graph and returns placeholders shaped as the graph's outputs.

    For the programs whose graph communicates (the window's all-reduce traced into the update under DDP): building
    them runs no collective, so a process whose build fails never leaves another waiting in one (the build's own
    run is on copies of the state and its outputs are not read); the processes agree on what they built afterwards,
    before any program runs (``sink/programs/build_agreement.py``)."""

    def __init__(self, backend: str, options: dict[str, Any] | None) -> None:
        self._compile = backend_compiler(backend, options)
        self._building = False

    @contextmanager
    def building(self) -> Iterator[None]:
        self._building = True
        try:
            yield
        finally:
            self._building = False

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled = self._compile(graph, example_inputs)
        outputs = graph_output_examples(graph)

        def run(*args: Any) -> Any:
            if self._building:
                return [_placeholder(value) for value in outputs]
            return compiled(*args)

        return called_as(compiled, run)


def _placeholder(example: Any) -> Any:
    if not isinstance(example, torch.Tensor):
        return example
    return torch.empty_strided(example.shape, example.stride(), dtype=example.dtype, device=example.device).zero_()


class CompiledPrograms:
    """Each traced program (``traced_programs.py``) compiled for ``device`` with ``backend``: the accumulate and
    update programs, the update in two parts (the eager route of the sum across processes: the all-reduce between
    them) and the call of several. ``quiet``: built without running (``BuildWithoutRunning``), for programs with a
    sum across processes traced in. ``one_loop_graph``: every call of two windows or more, whatever their number,
    runs one compiled graph of the loop, which on a CPU with Inductor can be kept on disk for later fits (``saved``:
    ``saved_loop.py``; unless ``LIGHTNING_SINK_SAVED_LOOP=0``)."""

    def __init__(self, traced: TracedPrograms, backend: str, device: torch.device, quiet: bool) -> None:
        options = compile_options(backend, device)
        if options and options.get("fallback_random"):
            # random operators draw eager's numbers in eager's order, in a loop over windows as well
            let_loops_order_random_draws()
        self._quiet = BuildWithoutRunning(backend, options) if quiet else None
        compiler, options = (backend, options) if self._quiet is None else (self._quiet, None)
        self.codes: list[CodeType] = []  # each program's own code object: TorchDynamo's versions are kept per code
        self.accumulate = compiled(traced.accumulate_program, compiler, options, self.codes)
        self.update = compiled(traced.update_program, compiler, options, self.codes)
        self.update_sum = compiled(traced.update_sum_program, compiler, options, self.codes)
        self.update_apply = compiled(traced.update_apply_program, compiler, options, self.codes)
        several = compiled(traced.several_program, compiler, options, self.codes)
        # (built without running, a program returns placeholders of its outputs' shapes, which must be known; and a
        # loop with an open size has been measured on CPUs only: elsewhere each length is built as a graph of its own)
        self.one_loop_graph = self._quiet is None and device.type == "cpu"
        self.several = _windows_may_vary(several) if self.one_loop_graph else several
        self.saved: SavedLoop | None = None  # the loop kept on disk for later fits (saved_loop.py)
        if self.one_loop_graph and backend == "inductor" and saved_loops_on():
            self.saved = SavedLoop(traced.several_program, options, self.several, _mark_windows)
            self.several = self.saved

    def building(self) -> contextlib.AbstractContextManager[None]:
        """Where the programs' first calls compile them: without running where they are built quietly."""
        return self._quiet.building() if self._quiet is not None else contextlib.nullcontext()


def _windows_may_vary(several: Callable[..., Any]) -> Callable[..., Any]:
    """The compiled loop over windows, told before each call that the number of windows (the first size of the
    hyperparameter rows and of the stacked batches) may vary: one graph, built once, serves calls of any number of
    windows (the longest call and the shorter ones; one window alone is a graph of its own, as torch specializes a
    size of one)."""

    def run(state: dict[str, Any], call: dict[str, Any]) -> Any:
        _mark_windows(call)
        return several(state, call)

    return run


def _mark_windows(call: dict[str, Any]) -> None:
    for rows in call["hyper"]:
        may_vary_in_size(rows, 0)
    tree_map(lambda leaf: may_vary_in_size(leaf, 0) if isinstance(leaf, torch.Tensor) else None, call["batches"])
