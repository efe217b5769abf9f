"""The ``openrlhf`` modules treadle provides, for reward (and agent) files written for OpenRLHF.

OpenRLHF's example files import helpers from its package (``math_reward_func.py``: ``from
openrlhf.utils import extract_boxed_answer, grade_answer``). When OpenRLHF is not installed,
``install()`` puts an import hook on ``sys.meta_path`` that serves::

    openrlhf.utils.extract_boxed_answer, grade_answer    treadle.rewards.openrlhf.math_utils (math-verify),
                                                         also as openrlhf.utils.math_utils
    openrlhf.utils.logging_utils.init_logger             treadle.rewards.openrlhf.logging_utils
    openrlhf.utils.agent                                 treadle.agents.openrlhf (treadle-agents)

and refuses every other module or name under ``openrlhf`` with ``OpenRLHFImportError``, which
names it and lists the above. ``check_imports(path)`` finds the same refusals in a file's source
(``ast``) before it runs, imports inside functions included (they would fail at the first call,
mid-run); an import under a ``try`` that catches ImportError is left to the file.

treadle-agents registers ``openrlhf.utils.agent`` itself when it loads an agent file first
(``install_openrlhf_alias``); ``install`` then adds the reward names to its ``openrlhf.utils``.
The agent module is named here by string and imported only when a file asks for it (rewards
sits below agents in the package graph), so the two work in either order in one process.
Nothing is installed or checked when OpenRLHF itself is installed: its modules answer.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PACKAGES = ("openrlhf", "openrlhf.utils")
"""Served as (empty) packages."""
ALIASES: dict[str, tuple[str, str]] = {
    "openrlhf.utils.math_utils": ("treadle.rewards.openrlhf.math_utils", "treadle-rewards[math]"),
    "openrlhf.utils.logging_utils": ("treadle.rewards.openrlhf.logging_utils", "treadle-rewards"),
    "openrlhf.utils.agent": ("treadle.agents.openrlhf", "treadle-agents"),
}
"""OpenRLHF module -> (the treadle module served under its name, the distribution that has it)."""
REEXPORTS: dict[str, dict[str, str]] = {
    "openrlhf.utils": {"extract_boxed_answer": "openrlhf.utils.math_utils", "grade_answer": "openrlhf.utils.math_utils"},
}
"""Names a package re-exports from a submodule (OpenRLHF's ``openrlhf/utils/__init__.py`` does)."""
NAMES: dict[str, tuple[str, ...] | None] = {
    "openrlhf": (),
    "openrlhf.utils": tuple(REEXPORTS["openrlhf.utils"]),
    "openrlhf.utils.math_utils": ("extract_boxed_answer", "grade_answer"),
    "openrlhf.utils.logging_utils": ("init_logger",),
    "openrlhf.utils.agent": None,  # treadle-agents' API: checked when imported, not from source
}
"""The names each served module has, for the source check."""
PROVIDED = ("openrlhf.utils.extract_boxed_answer and grade_answer (treadle's math verifier; also in "
            "openrlhf.utils.math_utils), openrlhf.utils.logging_utils.init_logger, and openrlhf.utils.agent "
            "(OpenRLHF's agent API, from treadle-agents)")


class OpenRLHFImportError(ImportError):
    """A file imports something from ``openrlhf`` that treadle does not provide (OpenRLHF not installed)."""


def _not_provided(what: str) -> str:
    return (f"{what} is not provided by treadle (OpenRLHF is not installed, and treadle serves only part of "
            f"its package): treadle provides {PROVIDED}. Use one of those, or install OpenRLHF")


def _ours(name: str) -> bool:
    return name == "openrlhf" or name.startswith("openrlhf.")


def _package_getattr(package: str) -> Callable[[str], Any]:
    """A module ``__getattr__``: re-exported names on first use, a named refusal for the rest."""

    def __getattr__(name: str) -> Any:
        if _served(f"{package}.{name}"):  # a served submodule not imported yet: ``openrlhf.utils.agent.X``
            return importlib.import_module(f"{package}.{name}")
        source = REEXPORTS.get(package, {}).get(name)
        if source is None:
            raise AttributeError(name if name.startswith("__") else _not_provided(f"{package}.{name}"))
        value = getattr(importlib.import_module(source), name)
        sys.modules[package].__dict__[name] = value
        return value

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``PACKAGES`` and ``ALIASES``; raises ``OpenRLHFImportError`` for other ``openrlhf.*``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not _ours(fullname):
            return None
        if fullname in PACKAGES or fullname in ALIASES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname in PACKAGES)
        # ImportError, not ModuleNotFoundError: ``from openrlhf.utils import x`` would swallow the latter
        raise OpenRLHFImportError(_not_provided(fullname), name=fullname)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: Any) -> None:
        name = module.__name__
        if name in PACKAGES:
            module.__getattr__ = _package_getattr(name)
            return
        target, dist = ALIASES[name]
        try:
            sys.modules[name] = importlib.import_module(target)  # the import system returns this replacement
        except ModuleNotFoundError as e:
            if e.name is None or not target.startswith(e.name):
                raise
            raise OpenRLHFImportError(f"{name} is provided by {dist}, which is not installed: "
                                      f"pip install '{dist}'", name=name) from e


_FINDER = _Finder()


def openrlhf_installed() -> bool:
    """Whether the real OpenRLHF is importable (or imported)."""
    mod = sys.modules.get("openrlhf")
    if mod is not None:
        return getattr(mod, "__file__", None) is not None  # treadle's modules have no file
    finders = [f for f in sys.meta_path if f is not _FINDER and hasattr(f, "find_spec")]
    return any(f.find_spec("openrlhf", None) is not None for f in finders)


def install() -> bool:
    """Serve treadle's ``openrlhf`` modules unless OpenRLHF is installed; True when they are in place.

    Idempotent. Where treadle-agents already registered plain ``openrlhf`` / ``openrlhf.utils``
    modules, they get the re-exported names and the named refusals too.
    """
    if openrlhf_installed():
        return False
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
    for name in PACKAGES:
        mod = sys.modules.get(name)
        if mod is not None and "__getattr__" not in vars(mod):
            mod.__getattr__ = _package_getattr(name)
    return True


def uninstall() -> None:
    """Remove the hook and the ``openrlhf`` modules treadle serves (tests; a fresh start)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name, mod in list(sys.modules.items()):
        if _ours(name) and (getattr(mod, "__file__", None) is None or mod.__name__ != name):  # shim or alias
            del sys.modules[name]


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(t is None or (isinstance(t, ast.Name) and t.id in
                             ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")) for t in types)


_TRY = (ast.Try, ast.TryStar) if hasattr(ast, "TryStar") else (ast.Try,)


def _import_nodes(node: ast.AST, guarded: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under ``node``, with whether a ``try`` around it catches ImportError."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, guarded
        return
    if isinstance(node, _TRY):
        inner = guarded or any(_catches_import_error(h) for h in node.handlers)
        for stmt in node.body:
            yield from _import_nodes(stmt, inner)
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            yield from _import_nodes(part, guarded)
        return
    for child in ast.iter_child_nodes(node):
        yield from _import_nodes(child, guarded)


def _served(module: str) -> bool:
    return module in PACKAGES or module in ALIASES


def _unprovided(node: ast.Import | ast.ImportFrom) -> list[str]:
    """What ``node`` imports from ``openrlhf`` that is not served (dotted names)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if _ours(a.name) and not _served(a.name)]
    module = node.module or ""
    if node.level or not _ours(module):
        return []
    if not _served(module):
        return [module]
    names = NAMES[module]
    return [f"{module}.{a.name}" for a in node.names
            if a.name != "*" and not _served(f"{module}.{a.name}") and names is not None and a.name not in names]


def check_imports(path: str | Path) -> None:
    """Raise ``OpenRLHFImportError`` (``path:line: ...``) for the first ``openrlhf`` import in the
    file that treadle does not serve; nothing when OpenRLHF is installed. Does not run the file."""
    if openrlhf_installed():
        return
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, ValueError):  # undecodable or not Python: importing the file reports it, as before
        return
    for node, guarded in _import_nodes(tree):
        missing = [] if guarded else _unprovided(node)
        if missing:
            raise OpenRLHFImportError(f"{path}:{node.lineno}: {_not_provided(missing[0])}", name=missing[0])
