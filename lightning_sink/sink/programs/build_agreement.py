"""Under DDP, what every process built: the same compiled pair and the same call lengths everywhere, or the
processes' all-reduces would not pair up. No build communicates (the programs with the window's all-reduce traced
in are built without running them: ``compiled/program_compile.py``), so every process reaches this agreement, and
makes its two collectives, whatever its own build did."""

from __future__ import annotations

from typing import Any

from lightning_sink.compiled import StepPrograms, Unavailable

__all__ = ["agreed_build"]


def agreed_build(strategy: Any, built: StepPrograms | Unavailable) -> StepPrograms | Unavailable:
    """``built``, or what every process can run: a process without programs makes every process fall back
    (``Unavailable``); one whose loop over windows did not build makes every process run one micro-step per call
    (each built those too). ``strategy``: the fit's Lightning strategy, whose collectives agree."""
    built_everywhere = strategy.reduce_boolean_decision(not isinstance(built, Unavailable), all=True)
    if not built_everywhere:
        if not isinstance(built, Unavailable):
            built.rule.discard_created()
        return Unavailable("another process could not build its programs (its warning names the reason)")
    assert not isinstance(built, Unavailable)
    first = strategy.broadcast(built.call_lengths, src=0)
    if not strategy.reduce_boolean_decision(tuple(first) == built.call_lengths, all=True):
        built.drop_several(
            "one micro-step per call (the loop over windows did not build on every process: the line of the one"
            " where it did not says why)"
        )
    return built
