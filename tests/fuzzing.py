"""A seeded mutation fuzzer over the checkpoint formats the package reads from untrusted hands.

Formats and the entry point each mutated file goes through:

- ``layout``: a layout file, through ``load_layout``;
- ``manifest``: a resharded folder's ``MANIFEST.json``, through ``verify_checkpoint`` (deep);
- ``rank_file``: a rank file of a resharded folder with its manifest entry re-signed (so that the SHA-256 check
  passes and the parser is reached), through ``verify_checkpoint`` and ``load_resharded_checkpoint``;
- ``dcp_metadata``: a DCP folder's ``.metadata``, through ``transform_checkpoints``;
- ``dcp_ranks_metadata``: the ``.metadata`` of a DCP folder saved by several ranks (given: ``ranks_folder``; its
  names are pickled twice, once per rank's copy), with and without its ``layout.json``, through
  ``transform_checkpoints``;
- ``distcp``: a DCP storage file, through ``transform_checkpoints``;
- ``save_digests``: the ``SAVE_DIGESTS.json`` of a DCP folder this package saved, through the resume's check
  (``check_one_save``) and the conversion's (``check_save_digests``).

The oracle: a mutated input gives a correct result or a clean refusal - a ``ValueError`` or ``FileNotFoundError``
of one line naming the folder or file - never any other exception (a traceback for the user), never more than
``SECONDS_PER_CASE`` for one input, and the process's peak RSS grows by less than ``MAX_GROWTH_MIB`` over a run
and (where Linux lets the peak be reset) by less than ``MAX_CASE_GROWTH_MIB`` in any one case, whose files are a
few KiB. A conversion that succeeds must give an output ``verify_checkpoint`` accepts.
Used by ``tests/reshard/test_fuzz_formats.py`` (a fixed seed and a small budget) and
``benchmarks/fuzz_checkpoints.py`` (a larger one).
"""

from __future__ import annotations

import hashlib
import json
import random
import resource
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_sink.checkpoint_format.dcp_folder import save_dcp_atomically
from lightning_sink.checkpoint_format.dcp_load import check_one_save
from lightning_sink.checkpoint_format.save_digests import SAVE_DIGESTS_FILE, check_save_digests
from lightning_sink.layout import Chunk, Layout, MeshLayout, TensorLayout, layout_on_mesh, load_layout, save_layout
from lightning_sink.reshard import load_resharded_checkpoint, transform_checkpoints, verify_checkpoint

__all__ = ["FORMATS", "MAX_GROWTH_MIB", "SECONDS_PER_CASE", "Finding", "fuzz"]

SECONDS_PER_CASE = 20.0
MAX_GROWTH_MIB = 512
MAX_CASE_GROWTH_MIB = 256
FORMATS = ("layout", "manifest", "rank_file", "dcp_metadata", "distcp", "save_digests", "dcp_ranks_metadata")
_EXTREMES = [0, -1, 1, 2**31, 2**63, 10**30, 3 * 10**8, 1e308, -1e308, 0.5, True, None, "", "x", [], {}, [[]]]


@dataclass
class Finding:
    """One input the oracle rejects: the format, the case number and what went wrong."""

    format: str
    case: int
    problem: str


@dataclass
class _Fixtures:
    root: Path
    source: Path  # rank files of one 3x4 tensor and a vector, with layout.json
    resharded: Path  # the same converted to two ranks (MANIFEST.json, layout.json, two rank files)
    dcp: Path  # a one-rank DCP folder of the same state
    saved: Path  # the same state saved by this package (with SAVE_DIGESTS.json)
    target: Path  # the two-rank target layout file
    files: dict[str, bytes] = field(default_factory=dict)
    ranks: Path | None = None  # a DCP folder saved by several ranks, with its layout.json
    ranks_target: Path | None = None  # its tensors in rows over two ranks


def _ranks_fixtures(found: _Fixtures, ranks_folder: Path) -> None:
    layout = load_layout(ranks_folder / "layout.json")
    rows = layout_on_mesh(
        layout,
        MeshLayout.one_dimensional(2),
        lambda fqn, tensor: ["Shard(0)"] if tensor.global_shape else ["Replicate()"],
    )
    found.ranks, found.ranks_target = ranks_folder, save_layout(rows, found.root / "ranks_two.json")
    found.files["dcp_ranks_metadata"] = (ranks_folder / ".metadata").read_bytes()


def _fixtures(root: Path) -> _Fixtures:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(4, dtype=torch.float64)}
    source = root / "source"
    (source / "rank_0").mkdir(parents=True)
    torch.save(state, source / "rank_0" / "model.pt")
    tensors = {
        name: TensorLayout(
            role="parameter",
            global_shape=tuple(value.shape),
            dtype=str(value.dtype).removeprefix("torch."),
            placements=("Replicate()",),
            chunks=(Chunk(0, (0,) * value.dim(), tuple(value.shape)),),
        )
        for name, value in state.items()
    }
    one = Layout(world_size=1, mesh=MeshLayout.one_dimensional(1), tensors=tensors)
    save_layout(one, source / "layout.json")
    rows = layout_on_mesh(one, MeshLayout.one_dimensional(2), lambda fqn, tensor: ["Shard(0)"])
    target = save_layout(rows, root / "two.json")
    resharded = root / "resharded"
    transform_checkpoints(source, resharded, "ckpt_", None, target)
    folder = root / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**state, "step": 3}, checkpoint_id=folder, no_dist=True)
    saved = root / "saved"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_dcp_atomically(
            {**state, "step": 3}, {"epoch": 1}, saved, global_rank=0, world_size=1, barrier=lambda: None
        )
    found = _Fixtures(root, source, resharded, folder, saved, target)
    found.files = {
        "layout": (root / "two.json").read_bytes(),
        "manifest": (resharded / "MANIFEST.json").read_bytes(),
        "rank_file": (resharded / "rank_1" / "ckpt_1.pt").read_bytes(),
        "dcp_metadata": (folder / ".metadata").read_bytes(),
        "distcp": (folder / "__0_0.distcp").read_bytes(),
        "save_digests": (saved / SAVE_DIGESTS_FILE).read_bytes(),
    }
    return found


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4, 16))):
        kind = rng.randrange(6)
        at = rng.randrange(max(len(data), 1))
        if kind == 0 and data:  # a bit flip
            data[at] ^= 1 << rng.randrange(8)
        elif kind == 1 and data:  # a byte set to an edge value
            data[at] = rng.choice((0, 0xFF, 0x7F, 0x80, ord('"'), ord("\\"), ord("[")))
        elif kind == 2:  # truncated
            del data[at:]
        elif kind == 3 and data:  # a region deleted
            del data[at : at + rng.randrange(1, 64)]
        elif kind == 4 and data:  # a region duplicated
            data[at:at] = data[at : at + rng.randrange(1, 64)]
        else:  # random bytes inserted
            data[at:at] = rng.randbytes(rng.randrange(1, 16))
    return bytes(data)


def _paths(node: object, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node[:8]):
            found += _paths(value, (*prefix, index))
    return found


def _mutate_json(data: bytes, rng: random.Random) -> bytes:
    """A value somewhere in the document replaced by one of another kind or an extreme, or a key removed."""
    document = json.loads(data)
    for _ in range(rng.choice((1, 1, 2, 3))):
        path = rng.choice(_paths(document))
        if not path:
            document = rng.choice(_EXTREMES)
            break
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and rng.random() < 0.2:
            del parent[path[-1]]
        elif isinstance(parent, dict) and rng.random() < 0.1:
            parent[rng.choice((".", "..", "/etc/passwd", "rank_0/../../x", "a" * 300))] = parent.pop(path[-1])
        else:
            parent[path[-1]] = rng.choice(_EXTREMES)
    return json.dumps(document).encode()


def _mutated(kind: str, original: bytes, rng: random.Random) -> bytes:
    if kind in ("layout", "manifest", "save_digests") and rng.random() < 0.6:
        return _mutate_json(original, rng)
    return _mutate_bytes(original, rng)


def _resign(folder: Path, name: str) -> None:
    """Make the manifest list ``name``'s new bytes, as someone re-signing a tampered file would."""
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    data = (folder / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))


def _case(kind: str, fixtures: _Fixtures, data: bytes, work: Path) -> tuple[Callable[[], object], list[str]]:
    """Write the mutated file into a fresh copy of its folder; the call to make and the names an error must
    mention (one of them)."""
    if kind == "layout":
        path = work / "layout.json"
        path.write_bytes(data)
        return lambda: load_layout(path), [str(path)]
    if kind in ("manifest", "rank_file"):
        folder = Path(shutil.copytree(fixtures.resharded, work / "resharded"))
        if kind == "manifest":
            (folder / "MANIFEST.json").write_bytes(data)
        else:
            (folder / "rank_1" / "ckpt_1.pt").write_bytes(data)
            _resign(folder, "rank_1/ckpt_1.pt")

        def check() -> object:
            verify_checkpoint(folder)
            return load_resharded_checkpoint(folder / "rank_1" / "ckpt_1.pt")

        return check, [str(folder)]
    if kind == "save_digests":
        saved = Path(shutil.copytree(fixtures.saved, work / "saved"))
        (saved / SAVE_DIGESTS_FILE).write_bytes(data)
        names = sorted(path.name for path in saved.iterdir() if path.name != SAVE_DIGESTS_FILE)

        def check_saved() -> object:
            check_one_save(saved)
            return check_save_digests(saved, names, f"DCP checkpoint {str(saved)!r}")

        return check_saved, [str(saved)]
    if kind == "dcp_ranks_metadata":
        assert fixtures.ranks is not None and fixtures.ranks_target is not None
        folder = Path(shutil.copytree(fixtures.ranks, work / "ranks"))
        if len(data) % 2:  # half the inputs without the layout file: the metadata alone then says everything
            (folder / "layout.json").unlink()
        (folder / ".metadata").write_bytes(data)
        return _converted_and_verified(folder, work / "out", fixtures.ranks_target), [str(folder)]
    folder = Path(shutil.copytree(fixtures.dcp, work / "dcp"))
    (folder / (".metadata" if kind == "dcp_metadata" else "__0_0.distcp")).write_bytes(data)
    return _converted_and_verified(folder, work / "out", fixtures.target), [str(folder)]


def _converted_and_verified(folder: Path, out: Path, target: Path) -> Callable[[], object]:
    """The conversion; when it succeeds, its output must be one ``verify_checkpoint`` accepts."""

    def convert() -> object:
        report = transform_checkpoints(folder, out, "ckpt_", None, target)
        try:
            verify_checkpoint(out)
        except (ValueError, FileNotFoundError) as error:
            raise AssertionError(f"the conversion wrote what verify refuses: {error}") from None
        return report

    return convert


def _judge(call: Callable[[], object], names: list[str]) -> str | None:
    """None when the call succeeds or refuses cleanly; else what is wrong."""
    try:
        call()
    except (ValueError, FileNotFoundError) as error:
        message = str(error)
        if "\n" in message:
            return f"{type(error).__name__} of several lines: {message[:300]!r}"
        if not any(name in message for name in names):
            return f"{type(error).__name__} not naming the file: {message[:300]!r}"
        return None
    except Exception as error:  # the oracle's very point: anything else is a traceback for the user
        return f"{type(error).__name__}: {str(error)[:300]!r}"
    return None


def _peak_reset() -> bool:
    """Reset this process's peak RSS (VmHWM) where Linux allows it."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def _peak_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _run_case(kind: str, fixtures: _Fixtures, data: bytes, work: Path) -> str | None:
    """The oracle's verdict on one input: None, or what is wrong."""
    call, names = _case(kind, fixtures, data, work)
    measured = _peak_reset()
    before = _peak_mib() if measured else 0.0
    started = time.perf_counter()
    problem = _judge(call, names)
    seconds = time.perf_counter() - started
    growth = _peak_mib() - before if measured else 0.0
    if problem is None and seconds > SECONDS_PER_CASE:
        problem = f"took {seconds:.1f} s"
    if problem is None and growth > MAX_CASE_GROWTH_MIB:
        problem = f"peak RSS grew by {growth:.0f} MiB for a {len(data)}-byte file"
    return problem


def fuzz(
    seed: int, cases_per_format: int, formats: tuple[str, ...] = FORMATS, ranks_folder: Path | None = None
) -> list[Finding]:
    """Run ``cases_per_format`` mutations of each format; every input the oracle rejects, as a ``Finding``.
    ``ranks_folder``: the multi-rank DCP folder (with its ``layout.json``) that ``dcp_ranks_metadata`` needs."""
    if "dcp_ranks_metadata" in formats and ranks_folder is None:
        raise ValueError("the dcp_ranks_metadata format needs ranks_folder, a DCP folder saved by several ranks")
    findings: list[Finding] = []
    rng = random.Random(seed)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with tempfile.TemporaryDirectory(prefix="fuzz_checkpoints_") as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fixtures = _fixtures(Path(scratch))
        if ranks_folder is not None:
            _ranks_fixtures(fixtures, Path(ranks_folder))
        for kind in formats:
            for case in range(cases_per_format):
                work = Path(scratch) / f"{kind}_{case}"
                work.mkdir()
                problem = _run_case(kind, fixtures, _mutated(kind, fixtures.files[kind], rng), work)
                if problem is not None:
                    findings.append(Finding(kind, case, problem))
                shutil.rmtree(work, ignore_errors=True)
    growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    if growth_mib > MAX_GROWTH_MIB:
        findings.append(Finding("all", -1, f"peak RSS grew by {growth_mib:.0f} MiB"))
    return findings
