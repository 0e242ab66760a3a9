"""``GuardIdentities``: the guards a saved program cannot keep, as paths and names of what sits there. A name must
be the same in another process exactly when the object is the same code; a path is followed, never evaluated."""

from __future__ import annotations

import enum
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from lightning_sink.compiled import guard_identities
from lightning_sink.compiled.guard_identities import GuardIdentities, PathNotFollowed, identity


def _scaled(factor: float):
    def scale(x):
        return x * factor

    return scale


def _shifted(factor: float):
    def scale(x):
        return x + factor

    return scale


class Holder:
    def __init__(self) -> None:
        self.net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
        self.table = {"first": _scaled(2.0), "second": len}


IDENTITY_IN_A_NEW_PROCESS = """
import sys
sys.path.insert(0, sys.argv[1])
from lightning_sink.compiled.guard_identities import identity
import lightning_sink.compiled.traced_programs as traced
import torch
namespace = {"__name__": "in_a_set"}
exec(sys.argv[2], namespace)
print(identity(traced._carry)); print(identity(traced.TracedPrograms.several_program)); print(identity(torch.optim))
print(identity(torch.optim.AdamW)); print(identity(torch.add)); print(identity(namespace["_in_a_set"]))
"""

# a function whose code holds a frozenset of strings, whose order follows each process's string hashing
IN_A_SET = """
def _in_a_set(name):
    return name in {"adam", "adamw", "sgd", "rmsprop", "lbfgs", "adagrad"}
"""
IN_A_SET_NAMESPACE: dict = {"__name__": "in_a_set"}
exec(compile(IN_A_SET, "in_a_set", "exec", dont_inherit=True), IN_A_SET_NAMESPACE)


def test_names_are_the_same_in_a_new_process():
    import torch

    import lightning_sink.compiled.traced_programs as traced

    here = [
        identity(traced._carry),
        identity(traced.TracedPrograms.several_program),
        identity(torch.optim),
        identity(torch.optim.AdamW),
        identity(torch.add),
        identity(IN_A_SET_NAMESPACE["_in_a_set"]),
    ]
    command = [sys.executable, "-c", IDENTITY_IN_A_NEW_PROCESS, ".", IN_A_SET]
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=300)
    assert done.stdout.splitlines() == here


def _offset(x, by=1.0, *, times=1.0):
    return (x + by) * times


def test_names_tell_code_and_closures_apart():
    assert identity(_scaled(2.0)) == identity(_scaled(2.0))
    named = identity(_offset)
    _offset.__defaults__ = (2.0,)  # (TorchDynamo reads defaults as constants of the trace)
    assert identity(_offset) != named
    _offset.__defaults__, _offset.__kwdefaults__ = (1.0,), {"times": 3.0}
    assert identity(_offset) != named
    _offset.__kwdefaults__ = {"times": 1.0}
    assert identity(_offset) == named
    assert identity(_scaled(2.0)) != identity(_scaled(3.0))  # (what the closure holds)
    assert identity(_scaled(2.0)) != identity(_shifted(2.0))  # (the same name and closure, other code)
    assert identity(nn.Linear) != identity(nn.Conv1d)
    assert identity(types) == "module types"
    assert identity(nn.Linear(2, 2)) == identity(nn.Linear(3, 3))  # (an instance: its class; its values are
    # TorchDynamo's saved guards)


def test_paths_are_followed_through_attributes_items_and_globals():
    holder = Holder()
    arguments = {"self": holder}
    program_globals = {"helper": _scaled(2.0)}
    paths = [
        "self.net._modules['1'].__class__",
        "self.table['first']",
        "dict(type(self).__dict__)['__init__']",
        "self.table[list(dict.keys(self.table))[1]]",
        "G['helper']",
        "G['__import_torch_dot_nn'].Linear",
        "__import__('torch.nn').nn.functional.dropout",
        "G['__builtins_dict___0']['len']",
    ]
    recorded = GuardIdentities.recorded(paths, arguments, program_globals)
    assert dict(recorded.entries)["self.net._modules['1'].__class__"] == identity(nn.Dropout)
    assert dict(recorded.entries)["self.table[list(dict.keys(self.table))[1]]"] == identity(len)
    assert recorded.first_difference(arguments, program_globals) is None

    holder.table["first"] = _scaled(3.0)
    difference = recorded.first_difference(arguments, program_globals)
    assert difference is not None and difference.startswith("self.table['first']: function"), difference
    del holder.net._modules["1"]
    difference = recorded.first_difference(arguments, program_globals)
    assert difference == "self.net._modules['1'].__class__: not found (KeyError)", difference


@pytest.mark.parametrize(
    "path",
    [
        "__import__('os').system('touch should_not_exist')",
        "self.net.forward(1)",
        "getattr(self, 'net')",
        "__import__('a_module_never_imported_here')",
        "G['__import_a_module_never_imported_here'].x",
        "self.net[0 + 1]",
        "lambda: 1",
    ],
)
def test_a_path_that_would_run_code_or_import_is_refused(path: str, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PathNotFollowed):
        GuardIdentities.recorded([path], {"self": Holder()}, {})
    try:  # (as a saved entry names it: refused when the entry is read, or not found when followed)
        difference = GuardIdentities([(path, "anything")]).first_difference({"self": Holder()}, {})
    except PathNotFollowed:
        difference = "refused"
    assert difference == "refused" or "not found (PathNotFollowed)" in difference, difference
    assert not (tmp_path / "should_not_exist").exists()
    assert "a_module_never_imported_here" not in sys.modules
    guard_identities._getter.cache_clear()


class Colour(enum.Enum):
    RED = 1
    GREEN = 2
    CRIMSON = 1  # (an alias: the member RED)


def test_an_enum_member_is_named_by_its_member_and_a_container_by_what_it_holds():
    assert identity(Colour.RED) != identity(Colour.GREEN)
    assert identity(Colour.CRIMSON) == identity(Colour.RED)
    assert identity({"w": 1.0}) != identity({"w": 2.0}) and identity([1, 2]) != identity([2, 1])
    assert identity({1, 2}) == identity({2, 1}) and identity(()) != identity([])
    assert "of 100 items" in identity(list(range(100)))  # (bounded: a long container by its length)
    assert identity(torch.bfloat16) != identity(torch.float32)  # (a module-level dtype the step casts to)


def test_a_container_changed_in_place_is_seen_at_the_next_check():
    hooks: dict[int, object] = {}
    holder = Holder()
    holder.table = hooks
    recorded = GuardIdentities.recorded(["self.table"], {"self": holder}, {})
    assert recorded.first_difference({"self": holder}, {}) is None
    hooks[0] = _scaled(2.0)  # (the same dict object, now holding a hook)
    difference = recorded.first_difference({"self": holder}, {})
    assert difference is not None and difference.startswith("self.table: class builtins.dict ["), difference


def _with_default(values=[1.0]):  # noqa: B006 (a mutable default is the case under test)
    return values


def _counter():
    count = 0

    def counted():
        return count

    def bump():
        nonlocal count
        count += 1

    return counted, bump


def test_a_check_that_names_nothing_again_still_sees_what_changed_inside_an_object_it_saw_before():
    """A check names an object again only when what its name reads changed; the changes below leave the function,
    its defaults tuple and its closure cell the same objects, so only what they hold tells them apart."""
    counted, bump = _counter()
    holder = Holder()
    holder.table = {"default": _with_default, "closure": counted, "nested": {"inner": [1, 2]}, "zero": 0.0}
    changes = [
        ("self.table['default']", lambda: _with_default.__defaults__[0].append(2.0)),
        ("self.table['closure']", bump),
        ("self.table", lambda: holder.table["nested"]["inner"].append(3)),
        ("self.table['zero']", lambda: holder.table.__setitem__("zero", -0.0)),  # (equal to 0.0, named apart)
    ]
    for path, change in changes:  # (each path checked alone: its own check must see its change)
        recorded = GuardIdentities.recorded([path], {"self": holder}, {})
        assert recorded.first_difference({"self": holder}, {}) is None
        assert recorded.first_difference({"self": holder}, {}) is None  # (nothing named again: the same reads)
        change()
        difference = recorded.first_difference({"self": holder}, {})
        assert difference is not None and difference.startswith(f"{path}: "), (path, difference)
    _with_default.__defaults__[0][:] = [1.0]


def test_objects_whose_reads_are_equal_have_the_same_name():
    """What lets a check skip naming: equal reads must mean equal names, over values built at random from every
    kind ``identity`` names (plain values of look-alike types, containers nested past its depth, functions)."""
    import random

    rng = random.Random(7)
    leaves = [0, 1, True, 1.0, -0.0, 0.0, float("nan"), "a", b"a", None, torch.float32, Colour.RED, types, len, _offset]

    def build(depth: int):
        kind = rng.randrange(6 if depth < 5 else 1)
        if kind == 0:
            return rng.choice(leaves)
        items = [build(depth + 1) for _ in range(rng.randrange(3))]
        if kind == 1:
            return items
        if kind == 2:
            return tuple(items)
        if kind == 3:
            return {rng.choice(["k", 1, True]): item for item in items}
        if kind == 4:
            return _scaled(rng.choice([2.0, 3.0]))
        return _with_default

    values = [build(0) for _ in range(400)]
    read = [(guard_identities._reads(value), identity(value), value) for value in values]
    pairs = 0
    for reads_a, name_a, a in read:
        for reads_b, name_b, b in read:
            if reads_a == reads_b:
                pairs += 1
                assert name_a == name_b, (a, b)
    assert pairs > len(values)  # (some different objects read alike: the test compares something)
