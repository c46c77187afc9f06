"""The package's layers (docs/architecture.md): a module imports only from
its own layer and the layers below it, never from above, and nothing in the
package imports :mod:`ecstore.testing`.

Checked on the source itself: every ``import`` of an ``ecstore`` module in
every file of the package, including imports inside functions and under
``TYPE_CHECKING`` (a type-only upward import still ties a lower layer to an
upper one)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import ecstore

PACKAGE = Path(ecstore.__file__).parent

#: Low to high. The top-level name under ``ecstore`` (a subpackage or a
#: module) -> its layer; ``ecstore`` itself is the package's public facade
#: (it re-exports the handle), at the handle's layer.
LAYERS: dict[str, int] = {
    **dict.fromkeys(("errors", "key", "identity", "pool"), 0),  # leaves
    "format": 1,  # the one place bytes are interpreted
    **dict.fromkeys(("lmdb", "memory", "remote"), 2),  # the tiers
    "config": 3,  # ECStoreConfig: parses the tiers' settings (lmdb file modes, remote urls)
    **dict.fromkeys(("store", ""), 4),  # the handle; "" is the facade ecstore/__init__.py
    **dict.fromkeys(("maintenance", "connector"), 5),
    "cli": 6,
}
#: Ships what tests and tools need: may import anything, imported by nothing.
TESTING = "testing"


@dataclass(frozen=True)
class Import:
    """One ``ecstore`` import: the importing file and line, and the module
    imported (dotted, ``ecstore...``)."""

    path: Path
    line: int
    source: str  # the importing module, dotted
    target: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(PACKAGE.parent)}:{self.line}: {self.source} imports {self.target}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def imports_in(text: str, path: Path) -> list[Import]:
    """Every import of an ``ecstore`` module in ``text``, the source of the
    package's file ``path`` (``from ecstore.x import y`` names module
    ``ecstore.x.y`` where that is a module, else ``ecstore.x``)."""
    source = _module_name(path)
    out: list[Import] = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"  # ruff bans them too
            mod = node.module or ""
            targets = [f"{mod}.{a.name}" if _is_module(f"{mod}.{a.name}") else mod for a in node.names]
        else:
            continue
        out += [Import(path, node.lineno, source, t) for t in targets
                if t == "ecstore" or t.startswith("ecstore.")]
    return out


def top(dotted: str) -> str:
    """``ecstore.lmdb.tier`` -> ``lmdb``; ``ecstore`` -> ``""``."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(found: list[Import]) -> list[str]:
    bad = []
    for imp in found:
        src, dst = top(imp.source), top(imp.target)
        if src == TESTING:
            continue
        if dst == TESTING:
            bad.append(f"{imp} (nothing in the package imports ecstore.testing)")
        elif src not in LAYERS or dst not in LAYERS:
            bad.append(f"{imp} (a top-level name with no layer: add it to LAYERS and docs/architecture.md)")
        elif LAYERS[dst] > LAYERS[src]:
            bad.append(f"{imp} (upward: {src or 'ecstore'} is layer {LAYERS[src]}, {dst} layer {LAYERS[dst]})")
    return bad


def all_imports() -> list[Import]:
    return [imp for path in sorted(PACKAGE.rglob("*.py"))
            for imp in imports_in(path.read_text(encoding="utf-8"), path)]


def test_no_module_imports_from_a_layer_above_it() -> None:
    found = all_imports()
    assert len({imp.path for imp in found}) > 50, "the scan found too few files importing ecstore"
    bad = violations(found)
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_every_top_level_name_has_a_layer() -> None:
    names = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert names - set(LAYERS) == {TESTING}


@pytest.mark.parametrize(("source", "target", "upward"), [
    ("ecstore/lmdb/tier.py", "from ecstore.config.limits import MAX_LEASE_SECONDS", True),
    ("ecstore/format/codec.py", "import ecstore.store.handle", True),
    ("ecstore/remote/tier.py", "if TYPE_CHECKING:\n    from ecstore.store import ECStore", True),
    ("ecstore/connector/worker_side.py", "def f():\n    from ecstore.testing import faults", True),
    ("ecstore/store/handle.py", "from ecstore.lmdb import LMDBTier", False),
    ("ecstore/cli/parser.py", "from ecstore import __version__", False),
    ("ecstore/testing/faults.py", "from ecstore.cli import main", False),
])
def test_the_check_catches_an_upward_import(source: str, target: str, upward: bool) -> None:
    """The check itself, on planted sources: it must see an upward import
    wherever it is written (module level, under TYPE_CHECKING, in a function)."""
    assert bool(violations(imports_in(target, PACKAGE.parent / source))) is upward


#: A handle's tiers, as attributes of ECStore.
TIER_ATTRIBUTES = {"memory", "disk", "remote", "_tiers", "_writer", "_reads", "_puts"}


def test_nothing_outside_ecstore_store_reaches_into_a_handles_tiers() -> None:
    """The connector, maintenance and the cli talk to the handle, never past
    it: no ``<store>.memory`` / ``.disk`` / ``.remote`` (or the handle's
    private parts) on anything named like a handle (``store``, ``_store``,
    ``self.store``, ``self._store``)."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if top(_module_name(path)) in ("store", TESTING):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not (isinstance(node, ast.Attribute) and node.attr in TIER_ATTRIBUTES):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name in ("store", "_store"):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "reaches past the handle (add an ECStore method instead):\n" + "\n".join(bad)
