#!/usr/bin/env python3
"""Keep treadle's import graph a DAG and its light modules light.

Checks, statically (ast) over every module under packages/*/src and integration/src:
1. A package imports only the packages DESIGN.md allows:
   common <- rollout, rewards, agents <- trainer <- integration.
2. Nobody imports a sibling's internals (a module or name whose path has a part starting with "_"),
   nor the sibling subpackages named in ``PRIVATE``: the trainer talks to the rollout engines
   through ``treadle.rollout``'s client and ``treadle.common``'s weight protocol, never their
   internals; the launcher uses the trainer's config and daemon modules, not its RL loop or sender.
3. Light modules (all of treadle.common, and the client modules listed in LIGHT) import none of
   torch, deepspeed, vllm, ray, transformers at module level ("import time"); imports inside a
   function or under ``if TYPE_CHECKING:`` are fine.
Then, dynamically, it imports every light module in a fresh interpreter and checks that none of
the heavy packages ended up in ``sys.modules``.

Exit status 0 when clean, 1 with one line per violation otherwise.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "rollout": {"common"},
    "rewards": {"common"},
    "agents": {"common", "rollout", "rewards"},
    "trainer": {"common", "rollout", "rewards", "agents"},
    "integration": {"common", "rollout", "rewards", "agents", "trainer"},
}
PRIVATE: dict[str, tuple[str, ...]] = {  # importer -> module prefixes it may not import
    "trainer": ("treadle.rollout.engine",),
    "integration": ("treadle.trainer.rl", "treadle.trainer.weights", "treadle.trainer.trainers"),
}
HEAVY = ("torch", "deepspeed", "vllm", "ray", "transformers")
# Modules outside treadle.common that must stay importable without the heavy stack (client-only installs).
LIGHT_EXTRA = ("treadle.rollout.client", "treadle.rewards.client", "treadle.agents.client")


def source_roots() -> dict[str, Path]:
    roots = {name: ROOT / "packages" / name / "src" for name in ALLOWED if name != "integration"}
    roots["integration"] = ROOT / "integration" / "src"
    return roots


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_light(mod: str) -> bool:
    return mod == "treadle.common" or mod.startswith("treadle.common.") or any(
        mod == m or mod.startswith(m + ".") for m in LIGHT_EXTRA
    )


class _Visitor(ast.NodeVisitor):
    """Collects (lineno, imported module, imported names, at_module_level) per import."""

    def __init__(self) -> None:
        self.imports: list[tuple[int, str, list[str], bool]] = []
        self._depth = 0

    def _nested(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _nested

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            self._depth += 1
            for child in node.body:
                self.visit(child)
            self._depth -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.imports.append((node.lineno, alias.name, [], self._depth == 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self.imports.append((node.lineno, node.module, [a.name for a in node.names], self._depth == 0))


def check_file(path: Path, pkg: str, mod: str) -> list[str]:
    problems = []
    visitor = _Visitor()
    visitor.visit(ast.parse(path.read_text(), filename=str(path)))
    rel = path.relative_to(ROOT)
    for lineno, target, names, top in visitor.imports:
        parts = target.split(".")
        if parts[0] == "treadle" and len(parts) > 1:
            dep = parts[1]
            if dep != pkg:
                if dep not in ALLOWED.get(pkg, set()):
                    problems.append(f"{rel}:{lineno}: treadle.{pkg} may not import treadle.{dep} ({target})")
                if any(target == p or target.startswith(p + ".") for p in PRIVATE.get(pkg, ())):
                    problems.append(f"{rel}:{lineno}: treadle.{pkg} may not import {target} (see PRIVATE)")
                hidden = [p for p in parts[2:] + names if p.startswith("_") and not p.startswith("__")]
                if hidden:
                    problems.append(f"{rel}:{lineno}: imports internals of treadle.{dep}: {target} {names}")
        if top and is_light(mod) and parts[0] in HEAVY:
            problems.append(f"{rel}:{lineno}: light module {mod} imports {parts[0]} at import time")
    return problems


def dynamic_check(light: list[str]) -> list[str]:
    if not light:
        return []
    paths = [str(p) for p in source_roots().values()]
    code = (
        "import importlib, sys\n"
        f"sys.path[:0] = {paths!r}\n"
        f"for m in {light!r}:\n"
        "    importlib.import_module(m)\n"
        f"print(','.join(h for h in {HEAVY!r} if h in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return [f"importing light modules failed:\n{out.stderr.strip()[-2000:]}"]
    heavy = [h for h in out.stdout.strip().split(",") if h]
    return [f"importing the light modules pulled in: {', '.join(heavy)}"] if heavy else []


def main() -> int:
    problems: list[str] = []
    light: list[str] = []
    for pkg, src in source_roots().items():
        if not src.exists():
            continue
        stray = src / "treadle" / "__init__.py"
        if stray.exists():
            problems.append(f"{stray.relative_to(ROOT)}: treadle is a PEP 420 namespace; remove this file")
        for path in sorted(src.rglob("*.py")):
            mod = module_name(path, src)
            problems += check_file(path, pkg, mod)
            if is_light(mod) and not mod.endswith("__main__"):
                light.append(mod)
    problems += dynamic_check(light)
    for p in problems:
        print(p)
    print(f"check_imports: {len(light)} light modules, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
