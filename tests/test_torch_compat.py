"""Fails loudly, naming the API, when a torch release moves or changes a private API ``_torch_compat`` relies on;
and no module of the package imports a private torch module except ``_torch_compat``."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.tensor.placement_types import Shard

import lightning_sink
from lightning_sink import _torch_compat as compat
from lightning_sink.compiled.program_compile import inductor_options
from lightning_sink.layout.dcp_metadata import read_dcp_metadata

PACKAGE = Path(lightning_sink.__file__).parent


def test_private_names_still_exist_and_behave():
    flat, mapping = compat.flatten_state_dict({"a": {"b": torch.zeros(1)}, "c": 1})
    assert set(flat) == {"a.b", "c"} and mapping["a.b"] == ("a", "b")
    nested: dict = {"a": {"b": None}}
    compat.set_element(nested, ("a", "b"), 7)
    assert nested == {"a": {"b": 7}}
    sizes, offsets = compat.compute_local_shape_and_global_offset((5,), (2,), [1], [Shard(0)])
    assert (tuple(sizes), tuple(offsets)) == ((2,), (3,))  # torch.chunk rows: 3 and 2
    strided = compat.StridedShard(0, split_factor=2)
    assert strided.dim == 0 and strided.split_factor == 2
    iterator = compat.batch_reading_iterator(
        torch.utils.data.DataLoader(torch.arange(5), batch_size=2), lambda indices: ("read", indices)
    )
    assert list(iterator) == [("read", [0, 1]), ("read", [2, 3]), ("read", [4])]  # the sampler's indices, as drawn


def test_batch_reading_skips_only_the_profiling_scope_and_keeps_it_under_a_profiler():
    """Without a profiler the reading iterator skips the loader's ``record_function`` scope and nothing else: the
    loader's own ``__next__`` still does exactly the scope, the sampler read, the yield count and (for iterable
    datasets, not read this way) a length check. Under a profiler the scope is recorded as the loader records it."""
    source = inspect.getsource(torch.utils.data.dataloader._BaseDataLoaderIter.__next__)
    body = [line.strip() for line in source.splitlines()[1:] if line.strip() and not line.strip().startswith("#")]
    assert body[0].startswith("with torch.autograd.profiler.record_function(self._profile_name)")
    assert "data = self._next_data()" in body and "self._num_yielded += 1" in body and "return data" in body
    assert any("_DatasetKind.Iterable" in line for line in body)

    def read(loader: torch.utils.data.DataLoader) -> tuple[list, int]:
        iterator = compat.batch_reading_iterator(loader, lambda indices: list(indices))
        return list(iterator), iterator._num_yielded  # type: ignore[attr-defined]

    loader = torch.utils.data.DataLoader(torch.arange(7), batch_size=3, shuffle=True)
    torch.manual_seed(3)
    quiet = read(loader)
    torch.manual_seed(3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        profiled = read(loader)
    assert quiet == profiled and quiet[1] == 3 and sorted(i for batch in quiet[0] for i in batch) == list(range(7))
    scopes = [event.name for event in profiler.events() if event.name.startswith("enumerate(DataLoader)")]
    assert len(scopes) == 4  # one per batch and one for the call that finds the pass ended, as the loader records


def test_a_loaders_batch_reads_are_replaced_and_restored():
    loader = torch.utils.data.DataLoader(torch.arange(5), batch_size=2)
    assert compat.read_batches_with(loader, lambda _: lambda indices: ("read", indices))
    assert list(loader) == [("read", [0, 1]), ("read", [2, 3]), ("read", [4])]
    assert not compat.read_batches_with(loader, lambda _: None)  # already replaced: left as it is
    assert list(loader) == [("read", [0, 1]), ("read", [2, 3]), ("read", [4])]
    compat.restore_batch_reads(loader)
    assert compat.read_batches_with(loader, lambda _: None)  # the reader declines at the pass's start: own reads
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4]]
    compat.restore_batch_reads(loader)
    assert "_get_iterator" not in vars(loader)
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4]]


def test_dcp_reader_and_planner_hooks_are_the_ones_overridden():
    """``read_metadata`` and ``load_bytes`` keep their signatures, and the planner still keeps the attributes the
    weights-only ``load_bytes`` fills."""
    assert list(inspect.signature(FileSystemReader.read_metadata).parameters) == ["self", "args", "kwargs"]
    assert list(inspect.signature(DefaultLoadPlanner.load_bytes).parameters) == ["self", "read_item", "value"]
    source = inspect.getsource(DefaultLoadPlanner.load_bytes)
    assert "self.original_state_dict" in source and "self.mappings" in source and "self.flatten_state_dict" in source


def test_the_checked_reader_and_weights_only_planner_load_a_real_folder(tmp_path: Path):
    state = {"w": torch.arange(4.0), "note": {"lr": 0.5, "betas": (0.9, 0.99)}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=tmp_path)
        loaded = {"w": torch.zeros(4), "note": {"lr": 0.0, "betas": (0.0, 0.0)}}
        dcp.load(
            loaded,
            storage_reader=compat.MetadataCheckedReader(tmp_path, read_dcp_metadata),
            planner=compat.WeightsOnlyLoadPlanner(),
        )
    assert torch.equal(loaded["w"], state["w"]) and loaded["note"] == state["note"]
    reader = compat.MetadataCheckedReader(tmp_path, read_dcp_metadata)
    assert reader.read_metadata().storage_meta.load_id == reader.load_id


def test_only_torch_compat_imports_private_torch_modules():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "_torch_compat" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            imported = [alias.name for alias in node.names] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                if name.startswith("torch") and (
                    any(part.startswith("_") for part in name.split(".")) or any(n.startswith("_") for n in imported)
                ):
                    offenders.append(f"{path.relative_to(PACKAGE)}: {name} {imported}")
    assert offenders == []


def test_the_fake_process_group_comes_without_torch_testing():
    """Layout inference builds a mesh of N ranks in one process; torch's C++ fake process group is registered
    here, and no module of the package imports ``torch.testing`` (torch's own test utilities)."""
    code = (
        "import sys\n"
        "import torch.distributed as dist\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from lightning_sink._torch_compat import init_fake_process_group\n"
        "init_fake_process_group(4)\n"
        "mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))\n"
        "assert dist.get_world_size() == 4 and dist.get_rank() == 0 and tuple(mesh.shape) == (2, 2)\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[1]
    for path in (root / "lightning_sink").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [name for name in names if name.startswith("torch.testing")], f"{path} imports torch.testing"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_hooks_a_functional_step_would_skip_are_found():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    assert compat.hooks_a_functional_step_would_skip(module, optimizer) == []
    module[0].register_full_backward_hook(lambda *args: None)
    module[0].bias.register_post_accumulate_grad_hook(lambda param: None)
    optimizer.register_step_post_hook(lambda *args: None)
    assert compat.hooks_a_functional_step_would_skip(module, optimizer) == [
        "a backward hook on module '0'",
        "a gradient hook on parameter '0.bias'",
        "a step hook on the SGD optimizer",
    ]


def test_a_noted_optimizer_step_keeps_schedulers_from_warning():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    compat.note_optimizer_step(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)


def test_recompiled_functions_reads_torchdynamos_own_records_of_recompiles():
    torch._dynamo.reset()
    seen: list[torch.Tensor] = []

    def grows(x):
        seen.append(x)
        return x * len(seen)

    def breaks_then_grows(x):
        y = x + 1
        torch._dynamo.graph_break()
        seen.append(y)
        return y * len(seen)

    try:
        compiled, with_break = torch.compile(grows, backend="eager"), torch.compile(breaks_then_grows, backend="eager")
        for _ in range(3):
            compiled(torch.ones(2))
            with_break(torch.ones(2))
        found = {function.code.co_name: function for function in compat.recompiled_functions()}
        assert found["grows"].versions == 3  # one version per length of the list
        assert "seen" in found["grows"].last_guard_failure and "seen.append(x)" in found["grows"].last_guard_failure
        (resume,) = [function for name, function in found.items() if name.startswith("torch_dynamo_resume_in_")]
        assert compat.user_function_name(resume.code).startswith("breaks_then_grows (its part after the graph break")
        assert compat.user_function_name(grows.__code__) == "grows"
        assert compat.recompile_limit() == torch._dynamo.config.recompile_limit == 8
    finally:
        torch._dynamo.reset()


def test_a_storage_offset_in_file_is_where_its_bytes_are(tmp_path: Path):
    tensor = torch.arange(1000, dtype=torch.float32)
    torch.save({"t": tensor}, tmp_path / "t.pt")
    loaded = torch.load(tmp_path / "t.pt", map_location="meta", weights_only=True)["t"]
    offset = compat.storage_offset_in_file(loaded.untyped_storage())
    assert offset is not None
    raw = (tmp_path / "t.pt").read_bytes()[offset : offset + tensor.nbytes]
    assert raw == tensor.numpy().tobytes()
    assert compat.storage_offset_in_file(torch.zeros(3).untyped_storage()) is None  # not read from a file


def test_only_torch_compat_reads_private_torch_attributes():
    # the private attributes of torch objects the package relies on, each read through a _torch_compat function
    private = {"_checkpoint_offset"}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "_torch_compat" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: .{node.attr}")
    assert offenders == []


def test_the_compiled_graph_count_moves_with_each_compilation_only():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    before = compat.compiled_graph_count()
    compiled(torch.ones(3))
    first = compat.compiled_graph_count()
    compiled(torch.zeros(3))  # same shapes: the compiled graph is reused
    assert compat.compiled_graph_count() == first == before + 1
    compiled(torch.ones(5))  # a new shape: compiled again
    assert compat.compiled_graph_count() == first + 1
    torch._dynamo.reset()


def test_the_traced_all_reduce_is_one_graph_with_torch_compile(tmp_path: Path):
    """The compiled update program's traced route: the functional all-reduce sums over the group inside one
    ``fullgraph`` program (a 1-rank gloo group, in its own process)."""
    code = (
        "import torch, torch.distributed as dist\n"
        "from lightning_sink._torch_compat import compiled_graph_count, traced_all_reduce_sum\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'init'}', rank=0, world_size=1)\n"
        "program = torch.compile(lambda x: traced_all_reduce_sum(x * 2, dist.group.WORLD) + 1, fullgraph=True,"
        " backend='aot_eager')\n"
        "assert torch.equal(program(torch.arange(3.0)), torch.tensor([1.0, 3.0, 5.0]))\n"
        "assert compiled_graph_count() == 1\n"
        "dist.destroy_process_group()\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_inductor_settings_of_the_cpu_programs_are_known_to_this_torch():
    # the step programs leave out a setting Inductor no longer has (builds go on with its default); this fails instead
    scan = {"torch.ops.higher_order.scan": torch.__version__}
    cpu_settings = {
        "layout_optimization": False,
        "cpp_wrapper": True,
        "emulate_precision_casts": True,
        "fallback_random": True,
        "unsafe_marked_cacheable_functions": scan,
    }
    assert set(cpu_settings) <= compat.inductor_option_names()
    assert inductor_options(torch.device("cpu")) == cpu_settings
    assert inductor_options(torch.device("meta")) is None
    assert "no_such_setting" not in compat.inductor_option_names()


def test_the_inductor_cache_counts_see_a_graph_stored_and_then_reused(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    hits, misses = compat.inductor_cache_counts()
    torch.compile(lambda x: x.sin() * 3, backend="inductor", dynamic=False)(torch.ones(4))
    assert compat.inductor_cache_counts() == (hits, misses + 1)  # compiled, then stored
    torch._dynamo.reset()  # forget the compiled function: the next compile looks in the cache
    torch.compile(lambda x: x.sin() * 3, backend="inductor", dynamic=False)(torch.ones(4))
    assert compat.inductor_cache_counts() == (hits + 1, misses + 1)
    torch._dynamo.reset()


def test_a_loop_is_kept_in_inductors_caches_and_another_loop_is_not_taken_for_it(tmp_path: Path, monkeypatch):
    """With ``cached_loops_option`` (in the programs' settings) a graph holding torch's ``scan`` is stored in Inductor's cache and read back by
    the next compile of the same loop; a loop whose body differs (in one constant) is compiled apart, and each
    gives its own result."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def doubled(carry: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return carry + (x * 2).sum(), x.sum().reshape(1)

    def tripled(carry: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return carry + (x * 3).sum(), x.sum().reshape(1)

    def loop(body: Callable[..., Any]) -> Callable[..., Any]:
        options = inductor_options(torch.device("cpu"))  # the programs' settings: cached_loops_option among them
        return torch.compile(
            lambda carry, xs: compat.scan_loop(body, carry, xs),
            backend="inductor",
            fullgraph=True,
            dynamic=False,
            options=options,
        )

    start, xs = torch.zeros(()), torch.ones(4, 3)
    results = []
    for body in (doubled, doubled, tripled):
        torch._dynamo.reset()  # forget the compiled function: the next compile looks in the cache
        hits, _ = compat.inductor_cache_counts()
        results.append((loop(body)(start, xs)[0].item(), compat.inductor_cache_counts()[0] - hits))
    assert results == [(24.0, 0), (24.0, 1), (36.0, 0)]
    torch._dynamo.reset()


def test_a_loop_holds_random_draws_kept_in_eagers_order():
    """Three dropouts in the body of torch's ``scan`` built by Inductor with eager's random numbers
    (``fallback_random``, which orders the draws with ``control_deps``): with the rule the loop builds, and its
    carry, which every mask reaches, equals the same steps run eagerly from the same seed, bit for bit."""

    def body(carry: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.nn.functional.dropout(x + carry, 0.2, training=True)
        h = torch.nn.functional.dropout(h.relu(), 0.3, training=True)
        h = torch.nn.functional.dropout(h * 2, 0.5, training=True)
        return carry + h.sum() * 0.01, h.sum().reshape(1)

    compat.let_loops_order_random_draws()
    compat.let_loops_order_random_draws()  # (once per process: a second call changes nothing)
    torch._dynamo.reset()
    xs, start = torch.randn(20, 4, 3), torch.zeros(())
    looped = torch.compile(
        lambda carry, xs: compat.scan_loop(body, carry, xs),
        backend="inductor",
        fullgraph=True,
        options={"fallback_random": True},
    )
    torch.manual_seed(5)
    carry, _ = looped(start, xs)
    torch.manual_seed(5)
    expected = start
    for x in xs:
        expected, _ = body(expected, x)
    assert torch.equal(carry, expected)
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_program_built_without_running_compiles_then_runs_as_torch_compile_would(backend: str):
    # BuildWithoutRunning calls torch.compile's backend itself (backend_compiler), shapes its placeholders from
    # TorchDynamo's recorded outputs (graph_output_examples) and keeps the backend's calling convention (called_as)
    from lightning_sink.compiled.program_compile import BuildWithoutRunning, compiled

    class Program:
        def step(self, state: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            state["sum"].add_(x)
            return (state["sum"] * 2).sum(), state["sum"].reshape(2, 2) + 1

    options = inductor_options(torch.device("cpu")) if backend == "inductor" else None
    quiet = BuildWithoutRunning(backend, options)
    program = compiled(Program().step, quiet, None)
    state = {"sum": torch.ones(4)}
    with quiet.building():
        total, shifted = program({"sum": state["sum"].clone()}, torch.ones(4))
    assert total.shape == () and shifted.shape == (2, 2) and not total and not shifted.any()  # placeholders
    expected = Program().step({"sum": torch.ones(4)}, torch.full((4,), 3.0))
    calls = compat.compiled_graph_count()
    total, shifted = program(state, torch.full((4,), 3.0))  # the graph built above, now run
    assert compat.compiled_graph_count() == calls
    assert torch.equal(total, expected[0]) and torch.equal(shifted, expected[1])
    assert torch.equal(state["sum"], torch.full((4,), 4.0))
    with pytest.raises(ValueError, match="Inductor's"):
        compat.backend_compiler("aot_eager", {"fallback_random": True})


class _SavedHolder(torch.nn.Module):
    """A module as a LightningModule is for a saved program's guards: a ``_dtype`` attribute no guard reads (a dtype
    every tensor shares) and an optimizer reached through it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.scale = 2.0
        self._dtype = torch.float32
        self.optimizer = torch.optim.AdamW(self.linear.parameters(), lr=0.5)


def _saved_step(holder: _SavedHolder, x: torch.Tensor) -> torch.Tensor:
    return holder.linear(x) * holder.scale + holder.optimizer.param_groups[0]["lr"]


def test_a_program_saved_with_its_guards_loads_runs_and_checks_them(tmp_path: Path):
    """``compile_to_save``: the guards torch cannot save listed, the rest saved (a module's dtype attribute and an
    optimizer reached by the guards no obstacle); ``load_saved`` gives a program equal to eager whose saved guards
    refuse a changed value; the traced sources' checksums read the same now."""
    holder, x = _SavedHolder(), torch.randn(3, 2)
    dropped: list[compat.DroppedGuard] = []
    program = compat.compile_to_save(_saved_step, None, (holder, x), dropped)
    assert dropped and all(isinstance(guard.path, str) for guard in dropped)
    path = tmp_path / "program.bin"
    compat.save_program(program, path)
    loaded = compat.load_saved(path.read_bytes(), dict(globals()))
    assert compat.guards_pass(loaded, (holder, x))
    assert torch.allclose(loaded(holder, x), _saved_step(holder, x))
    sources = compat.inlined_sources(program)
    assert any(module == __name__ for module, *_ in sources)
    assert all(compat.source_checksum(module, first, last) == digest for module, first, last, digest in sources)
    assert compat.source_checksum("a_module_never_imported_here", 1, 2) is None
    holder.scale = 3.0
    assert not compat.guards_pass(loaded, (holder, x))


_COMPILED_AGAIN = """
import torch
from torch._dynamo.utils import counters
from lightning_sink import _torch_compat as compat


def step(linear, x):
    return linear(x).relu().sum()


linear, x = torch.nn.Linear(2, 2), torch.randn(3, 2)
program = compat.compile_to_save(step, None, (linear, x), [])
assert torch.allclose(program(linear, x), step(linear, x))
print("hits", counters["aot_autograd"]["autograd_cache_hit"])
"""


@pytest.mark.slow
def test_a_graph_compiled_again_to_be_saved_is_read_from_the_cache(tmp_path: Path):
    """A later process's ``compile_to_save`` of the same graph, its file edited elsewhere (a fit after an edit that
    left the traced code's graph as it was), takes the compiled graph from the entry the first process wrote in
    AOTAutograd's cache instead of compiling it whole again; an edit that changes the graph compiles it."""
    script = tmp_path / "step.py"
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    edited = _COMPILED_AGAIN + "\n# an edit elsewhere in the file\n"
    hits = []
    for version in (_COMPILED_AGAIN, edited, _COMPILED_AGAIN.replace(".relu()", ".sigmoid()")):
        script.write_text(version)
        run = [sys.executable, str(script)]
        done = subprocess.run(run, env=environment, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        hits.append(done.stdout.split()[-1])
    assert hits == ["0", "1", "0"]


def test_size_marks_come_off_and_the_cache_switch_is_read():
    tensor = torch.zeros(4, 2)
    compat.may_vary_in_size(tensor, 0)
    assert any(name.startswith("_dynamo") or name.startswith("_has_dynamo") for name in vars(tensor))
    compat.forget_size_marks(tensor)
    assert not any(name.startswith("_dynamo") or name.startswith("_has_dynamo") for name in vars(tensor))
    from torch._inductor import config

    # config.patch, not monkeypatch: monkeypatch's undo deletes an attribute a config module serves from its table,
    # which hides the setting from every later compile in this process.
    with config.patch(force_disable_caches=True):
        assert compat.caches_disabled()
    with config.patch(force_disable_caches=False):
        assert not compat.caches_disabled()
    assert config.force_disable_caches is not None


_COMPILED_TWICE = """
import torch
from torch._dynamo.utils import counters
from lightning_sink import _torch_compat as compat


def step(linear, x):
    return linear(x).relu().sum()


def other(linear, x):
    return linear(x).sigmoid().sum()


linear, x = torch.nn.Linear(2, 2), torch.randn(3, 2)
functions, programs, hits = (step, step, other), [], []
for function in functions:
    programs.append(compat.compile_to_save(function, None, (linear, x), []))
    hits.append(counters["aot_autograd"]["autograd_cache_hit"])
assert all(torch.allclose(program(linear, x), function(linear, x)) for program, function in zip(programs, functions))
assert not [name for name in globals() if name.startswith("__compiled_fn")], "a graph was put into the module"
print("hits", *hits)
"""


@pytest.mark.slow
def test_a_graph_compiled_again_to_be_saved_in_the_same_process_is_read_from_the_cache(tmp_path: Path):
    """A second ``compile_to_save`` of the same graph in one process takes it from AOTAutograd's cache; a third, of
    another graph, compiles it; each program runs its own graph, and none is put into the traced function's
    module."""
    script = tmp_path / "twice.py"
    script.write_text(_COMPILED_TWICE)
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    run = [sys.executable, str(script)]
    done = subprocess.run(run, env=environment, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["0", "1", "1"]
