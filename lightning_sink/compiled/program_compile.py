"""How a step program is compiled: ``torch.compile`` over the whole program, one graph, with Inductor's settings
for the device (``inductor_options``), each program with a code object of its own."""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable
from typing import Any

import torch

from lightning_sink._torch_compat import inductor_option_names
from lightning_sink.compiled.forward_compile import RANDOM_AS_EAGER

__all__ = ["compile_options", "compiled", "inductor_options"]

# why: ``inductor_options``; RANDOM_AS_EAGER: eager's random numbers (forward_compile.py)
_CPU_INDUCTOR_OPTIONS = {"layout_optimization": False, "cpp_wrapper": True, **RANDOM_AS_EAGER}
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
    ``fallback_random``: random operators (dropout) call eager's, so a program draws the numbers eager draws from
    the same seed (``forward_compile.py``). Elsewhere (CUDA)
    Inductor's defaults, with which the GPU figures of benchmarks/README.md were measured.
    """
    if device.type != "cpu":
        return None
    known = inductor_option_names()  # a setting this torch no longer has is left out, not an error at every build
    return {name: value for name, value in _CPU_INDUCTOR_OPTIONS.items() if name in known}


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


def compiled(program: Any, backend: str, options: dict[str, Any] | None) -> Callable[..., Any]:
    """``program`` (a bound method) compiled as one whole graph, for the shapes of its first call."""
    return torch.compile(_own_code(program), fullgraph=True, backend=backend, dynamic=False, options=options)
