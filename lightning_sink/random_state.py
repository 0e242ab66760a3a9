"""The process's global random generators in a checkpoint, so that a run drawing random numbers in its step (dropout,
random augmentations in the training process) resumes as the uninterrupted run.

Saved: torch's CPU generator, each CUDA device's generator (where CUDA is initialised in the process), Python's
``random`` and NumPy's global generator (where NumPy is installed). Under several processes every rank saves its
own, gathered into one list indexed by global rank. Everything is stored as tensors, ints, floats and ``None``, so
the checkpoint loads with ``torch.load(weights_only=True)``; a restored state is checked field by field first.

Not saved: generators a user holds (a ``torch.Generator`` passed to a loader is the data position's,
``data.py``; any other is the user's), and the seeds of loader worker processes, which each pass derives from a base
seed drawn when its iterator is created (from the loader's generator, or from torch's global generator restored
here).
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_sink.counts import is_int

__all__ = [
    "is_valid_generator_state",
    "capture_random_state",
    "restore_random_state",
    "gather_random_states",
    "restore_rank_random_state",
]

_PY_STATE_WORDS = 625  # Mersenne Twister: 624 words and the position
_NP_KEY_WORDS = 624
_WORD = 2**32


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # NumPy is optional: without it there is no NumPy state to save
        return None
    return numpy


def capture_random_state() -> dict[str, Any]:
    """This process's global generators, as tensors and numbers."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = _numpy()
    if numpy is not None:
        _, keys, position, has_gauss, cached_gaussian = numpy.random.get_state(legacy=True)
        state["numpy"] = {
            "keys": torch.from_numpy(keys.astype(numpy.int64)),
            "pos": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    return state


def _refuse(checkpoint_path: Any, field: str, expected: str) -> ValueError:
    return ValueError(f"{checkpoint_path}: the checkpoint's random state is not valid: {field} is not {expected}.")


def _int_tensor(value: object, words: int) -> bool:
    return (
        isinstance(value, Tensor)
        and value.dtype == torch.int64
        and value.shape == (words,)
        and bool(((value >= 0) & (value < _WORD)).all())
    )


def _byte_tensor(value: object, like: Tensor) -> bool:
    return isinstance(value, Tensor) and value.dtype == torch.uint8 and value.shape == like.shape


def _is_finite_float(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def is_valid_generator_state(state: Tensor) -> bool:
    """Whether torch's CPU generator accepts ``state`` (tried on a scratch generator: the global one is untouched;
    torch refuses, for instance, an MT19937 state of zeros)."""
    try:
        torch.Generator().set_state(state)
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def _checked(state: object, checkpoint_path: Any) -> dict[str, Any]:
    """``state`` if every field is what ``capture_random_state`` writes (any other value: one error naming it)."""
    if not isinstance(state, dict):
        raise _refuse(checkpoint_path, "the rank's state", "a dict")
    if not _byte_tensor(state.get("torch"), torch.get_rng_state()):
        raise _refuse(checkpoint_path, "'torch'", "a uint8 tensor of torch's CPU generator state")
    if not is_valid_generator_state(state["torch"]):
        raise _refuse(checkpoint_path, "'torch'", "a valid MT19937 state of torch's CPU generator (torch refuses it)")
    python = state.get("python")
    if not (
        isinstance(python, dict)
        and is_int(python.get("version"))
        and _int_tensor(python.get("internal"), _PY_STATE_WORDS)
        and (python.get("gauss_next") is None or _is_finite_float(python.get("gauss_next")))
    ):
        raise _refuse(checkpoint_path, "'python'", "Python's random state (version, 625 words, a finite gauss_next)")
    cuda = state.get("cuda", [])
    if not (isinstance(cuda, list) and all(isinstance(item, Tensor) and item.dtype == torch.uint8 for item in cuda)):
        raise _refuse(checkpoint_path, "'cuda'", "a list of uint8 tensors (one CUDA generator state per device)")
    numpy = state.get("numpy")
    if numpy is not None and not (
        isinstance(numpy, dict)
        and _int_tensor(numpy.get("keys"), _NP_KEY_WORDS)
        and is_int(numpy.get("pos"))
        and 0 <= numpy["pos"] <= _NP_KEY_WORDS
        and numpy.get("has_gauss") in (0, 1)
        and _is_finite_float(numpy.get("cached_gaussian"))
    ):
        raise _refuse(
            checkpoint_path, "'numpy'", "NumPy's MT19937 state (624 keys, pos, has_gauss, a finite cached_gaussian)"
        )
    return state


def restore_random_state(state: object, checkpoint_path: Any) -> None:
    """Set this process's global generators to a state ``capture_random_state`` returned (checked first). A
    generator the state does not hold (NumPy saved without NumPy installed, CUDA not initialised) is left as it is;
    CUDA states are restored for the devices both the saving and this process have."""
    checked = _checked(state, checkpoint_path)
    python = checked["python"]
    internal = tuple(int(word) for word in python["internal"].tolist())
    try:
        random.setstate((python["version"], internal, python["gauss_next"]))
    except (ValueError, TypeError) as error:
        raise _refuse(checkpoint_path, "'python'", f"a state Python's random accepts ({error})") from None
    numpy = _numpy()
    saved_numpy = checked.get("numpy")
    if numpy is not None and saved_numpy is not None:
        keys = saved_numpy["keys"].numpy().astype(numpy.uint32)
        numpy.random.set_state(
            ("MT19937", keys, saved_numpy["pos"], saved_numpy["has_gauss"], saved_numpy["cached_gaussian"])
        )
    if torch.cuda.is_available():
        for device, cuda_state in enumerate(checked.get("cuda", [])[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
    torch.set_rng_state(checked["torch"])


def gather_random_states(world_size: int) -> list[dict[str, Any]]:
    """Every rank's ``capture_random_state()``, indexed by global rank (a collective where ``world_size > 1``)."""
    own = capture_random_state()
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [own]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, own)
    return gathered


def restore_rank_random_state(saved: object, global_rank: int, world_size: int, checkpoint_path: Any) -> None:
    """This rank's saved state (``saved``: ``gather_random_states``' list). Saved by another number of ranks, no
    state is restored (which rank's generators would continue which is not defined), and rank zero says so."""
    if not isinstance(saved, list) or not saved:
        raise _refuse(checkpoint_path, "'random'", "a non-empty list of per-rank states")
    if len(saved) != world_size:
        rank_zero_warn(
            f"{checkpoint_path}: the random generators' state was saved by {len(saved)} rank(s) and this run has"
            f" {world_size}; the generators are not restored (they continue from this run's seeds)."
        )
        return
    restore_random_state(saved[global_rank], checkpoint_path)
