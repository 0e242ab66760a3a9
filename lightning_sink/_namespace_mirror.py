"""The package's Lightning-bound modules, served a second time for the standalone ``pytorch_lightning`` package.

``lightning.pytorch`` and ``pytorch_lightning`` are the same code published under two names (Lightning builds the
second by renaming the first's imports), but their classes are distinct: a ``pytorch_lightning.Trainer`` refuses a
strategy derived from ``lightning.pytorch.strategies.Strategy``, and every ``isinstance`` check and private attribute
the strategies use must target the package the Trainer comes from. So, as Lightning does, the same source files are
compiled a second time with their imports renamed, under ``lightning_sink.pytorch_lightning``:

- a module is *Lightning-bound* when it imports ``lightning.*``, or a Lightning-bound module of this package, or
  lives in a Lightning-bound package (importing it runs that package); the rest (loss scales, accumulation buffers,
  layouts, resharding) is shared by both namespaces, so one ``DynamicLossScale`` class serves both;
- a Lightning-bound module ``lightning_sink.X`` is served as ``lightning_sink.pytorch_lightning.X``: its own source
  file, parsed, with the module names of its import statements renamed (``lightning.pytorch`` -> ``pytorch_lightning``,
  ``lightning.fabric`` -> ``lightning_fabric``, a Lightning-bound ``lightning_sink.X`` -> its mirror, ``from
  lightning_sink import N`` -> ``from lightning_sink.pytorch_lightning import N``), and nothing else: no string,
  comment or attribute is touched, and line numbers are the file's own, so tracebacks show the real source.

Import forms the renaming cannot keep meaning the same (``import lightning``, ``import lightning.pytorch`` without
``as``, relative imports) are refused with the file and line when the mirror is built, not silently mistranslated.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import sys
from collections.abc import Sequence
from functools import cache
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

__all__ = [
    "MIRROR",
    "RENAMED_PACKAGES",
    "MirrorError",
    "bound_modules",
    "import_resolved",
    "install",
    "mirrored_source",
    "resolve",
]

SOURCE = "lightning_sink"
MIRROR = "lightning_sink.pytorch_lightning"
# lightning's subpackages and the standalone packages that publish the same code.
RENAMED_PACKAGES = {"lightning.pytorch": "pytorch_lightning", "lightning.fabric": "lightning_fabric"}
_ROOT = Path(__file__).resolve().parent


class MirrorError(ImportError):
    """A source file uses an import form whose renamed version would not mean the same thing."""


@cache
def _module_files() -> dict[str, Path]:
    """Every module of the package but its root and the mirror's own package: dotted name -> file."""
    files = {}
    for path in sorted(_ROOT.rglob("*.py")):
        parts = path.relative_to(_ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join((SOURCE, *parts))
        if parts and not name.startswith(MIRROR):
            files[name] = path
    return files


def _imported_names(tree: ast.AST, known: set[str]) -> set[str]:
    """Module names a file's import statements (anywhere in it) name, with ``from P import N`` naming P.N when that is
    a module of this package."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
            names.update(
                f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in known
            )
    return names


def _parents(name: str) -> list[str]:
    """The packages importing ``name`` runs, below the package root."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


@cache
def bound_modules() -> frozenset[str]:
    """The package's Lightning-bound modules (see the module docstring), found from the import statements alone."""
    files = _module_files()
    known = set(files)
    imports = {name: _imported_names(ast.parse(path.read_bytes(), str(path)), known) for name, path in files.items()}
    bound = {
        name
        for name, names in imports.items()
        if any(imported == "lightning" or imported.startswith("lightning.") for imported in names)
    }
    changed = True
    while changed:  # a fixed point: each pass adds the modules that reach a bound one, and their packages
        changed = False
        packages = {parent for name in bound for parent in _parents(name)} - bound
        if packages:  # a mirrored module's package is mirrored too (else its mirror has no parent to import under)
            bound |= packages
            changed = True
        for name, names in imports.items():
            reaches = {*names, *(parent for imported in names for parent in _parents(imported)), *_parents(name)}
            if name not in bound and reaches & bound:
                bound.add(name)
                changed = True
    return frozenset(bound)


def resolve(name: str) -> str:
    """The module a mirrored file gets for ``lightning_sink.``-relative ``name``: its mirror when bound, else itself."""
    full = f"{SOURCE}.{name}"
    return f"{MIRROR}.{name}" if full in bound_modules() else full


def _rename(module: str, where: str) -> str:
    if module == "lightning" or (module.startswith("lightning.") and not module.startswith(tuple(RENAMED_PACKAGES))):
        raise MirrorError(
            f"{where}: cannot mirror an import of {module!r} (only lightning.pytorch and lightning.fabric)"
        )
    for old, new in RENAMED_PACKAGES.items():
        if module == old or module.startswith(old + "."):
            return new + module[len(old) :]
    if module == SOURCE:
        return MIRROR
    if module in bound_modules():
        return MIRROR + module[len(SOURCE) :]
    return module


class _RenameImports(ast.NodeTransformer):
    def __init__(self, path: Path) -> None:
        self.path = path

    def visit_Import(self, node: ast.Import) -> ast.Import:
        for alias in node.names:
            renamed = _rename(alias.name, f"{self.path}:{node.lineno}")
            if renamed != alias.name and alias.asname is None and "." in alias.name:
                raise MirrorError(
                    f"{self.path}:{node.lineno}: `import {alias.name}` binds the name {alias.name.split('.')[0]!r};"
                    f" write `import {alias.name} as NAME` so that the mirror can rename it"
                )
            alias.name = renamed
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.ImportFrom:
        if node.level:
            raise MirrorError(f"{self.path}:{node.lineno}: relative imports are not mirrored; import absolutely")
        assert node.module is not None  # `from . import x` has level 1
        renamed = _rename(node.module, f"{self.path}:{node.lineno}")
        if renamed == node.module and node.module.startswith(SOURCE + "."):
            # from an unbound package: a bound submodule imported from it would be the original, not its mirror
            stray = [a.name for a in node.names if f"{node.module}.{a.name}" in bound_modules()]
            if stray:
                raise MirrorError(f"{self.path}:{node.lineno}: import {stray} as modules of their own")
        node.module = renamed
        return node


def mirrored_source(path: Path) -> ast.Module:
    """``path``'s syntax tree with its imports renamed for the ``pytorch_lightning`` namespace."""
    tree = ast.parse(path.read_bytes(), str(path))
    return _RenameImports(path).visit(tree)


class _MirrorLoader(importlib.abc.Loader):
    def __init__(self, path: Path) -> None:
        self.path = path

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        # Compiled on every import and never cached: a .pyc beside the source would be the original's cache slot.
        code = compile(mirrored_source(self.path), str(self.path), "exec", dont_inherit=True)
        exec(code, module.__dict__)


class _MirrorFinder(importlib.abc.MetaPathFinder):
    """Serves ``lightning_sink.pytorch_lightning.X`` for every Lightning-bound ``lightning_sink.X``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if not fullname.startswith(MIRROR + "."):
            return None
        original = SOURCE + fullname[len(MIRROR) :]
        if original not in bound_modules():
            return None  # shared modules are imported under their own name only
        file = _module_files()[original]
        spec = ModuleSpec(fullname, _MirrorLoader(file), origin=str(file), is_package=file.name == "__init__.py")
        spec.has_location = True  # __file__ is the real source file (tracebacks, inspect)
        return spec


def install() -> None:
    """Put the mirror's finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MirrorFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MirrorFinder())


def import_resolved(name: str) -> ModuleType:
    """Import ``lightning_sink.``-relative ``name`` as a mirrored file sees it."""
    return importlib.import_module(resolve(name))
