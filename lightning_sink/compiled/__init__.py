"""Compiled whole-step programs: each step program of a window (accumulate, update) one compiled function, and on a
GPU captured as a CUDA graph over a device-resident dataset. See docs/compiled_programs.md."""

from lightning_sink.compiled.autocast_region import AutocastRegion
from lightning_sink.compiled.optimizer_rules import OptimizerRule
from lightning_sink.compiled.program_build import build_step_programs
from lightning_sink.compiled.program_results import ProgramUnavailable, StepOutputs
from lightning_sink.compiled.program_settings import ProgramSettings
from lightning_sink.compiled.program_state import ProgramWindow
from lightning_sink.compiled.rank_sum import RankSum
from lightning_sink.compiled.step_programs import StepPrograms
from lightning_sink.compiled.support import Unavailable

__all__ = [
    "AutocastRegion",
    "OptimizerRule",
    "ProgramSettings",
    "ProgramUnavailable",
    "RankSum",
    "StepOutputs",
    "StepPrograms",
    "Unavailable",
    "ProgramWindow",
    "build_step_programs",
]
