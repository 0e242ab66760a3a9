"""The one line a build's refusal quotes from a compiler's error (``compiled.program_build.error_line``): what
broke and where in the user's code, also when the break is inside torch's loop, whose error's first line only
introduces the break ("... Got graph break/error:")."""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops.scan import scan

from lightning_sink.compiled.program_build import error_line


def _compile_error(function, *args):
    with pytest.raises(Exception) as caught:
        torch.compile(function, fullgraph=True, backend="eager")(*args)
    return caught.value


def test_a_graph_break_names_what_broke_and_the_users_line():
    def step(x):
        print("step")
        return x + 1

    line = error_line(_compile_error(step, torch.ones(2)))
    assert "\n" not in line
    assert line.startswith("Unsupported: ") and "`print`" in line, line
    assert line.endswith('(at test_error_line.py:22 in step: print("step"))'), line


def test_a_break_inside_a_loop_names_the_break_and_the_bodys_line_not_the_loops_header():
    def body(carry, x):
        print("body")
        return carry + x, carry

    def looped(xs):
        return scan(body, xs[0], xs)

    error = _compile_error(looped, torch.ones(3, 2))
    assert str(error).splitlines()[0].endswith("Got graph break/error:")  # (what the line used to stop at)
    line = error_line(error)
    assert "\n" not in line and "`print" in line, line
    assert line.endswith('(at test_error_line.py:33 in body: print("body"))'), line


def test_a_long_error_is_cut_and_a_plain_one_kept_whole():
    assert error_line(ValueError("short\nsecond line")) == "ValueError: short"
    long = error_line(RuntimeError("x" * 1000), limit=100)
    assert len(long) == 100 and long.endswith("...")
    assert error_line(RuntimeError("")) == "RuntimeError: "
