#!/usr/bin/env python3
"""No pickle on the wire: find every way treadle's own code could turn received bytes into objects
by running code (pickle and its kin), statically (ast) over packages/*/src and integration/src.

Rules (each finding is ``path:line: [rule] what``):

- ``pickle-module``: an import of pickle, cPickle, _pickle, cloudpickle, dill, marshal, shelve,
  joblib, jsonpickle or copyreg (anywhere: module level, inside a function, ``__import__``), and
  every call into one (``pickle.loads(...)``).
- ``torch-load``: ``torch.load(...)`` (or an alias of it) without ``weights_only=True``.
- ``numpy-allow-pickle``: any call passing ``allow_pickle=`` anything but a literal ``False``.
- ``mp-connection``: multiprocessing (or torch.multiprocessing) objects that pickle what they
  carry: ``multiprocessing.connection`` / ``.managers``, and ``Pipe``, ``Queue``,
  ``SimpleQueue``, ``JoinableQueue``, ``Manager``, ``Listener``, ``Client`` from the module, an
  alias of it, or a ``get_context()``.
- ``yaml-unsafe``: ``yaml.unsafe_load``, or ``yaml.load`` without a ``SafeLoader``.
- ``ray``: Ray's object store and actor calls (``ray.put``, ``ray.get``, ``X.remote(...)``)
  move arguments with cloudpickle.
- ``checkpoint-load``: ``X.load_checkpoint(...)`` (DeepSpeed's loader runs ``torch.load``).

``ALLOWED`` lists the legitimate local uses, one (path, rule) per entry with its reason; an
entry that no longer matches anything is reported too (stale), so the list stays true.
Exit status 0 when every finding is allowed, 1 otherwise.

    python tools/check_no_pickle.py            # the repo
    python tools/check_no_pickle.py FILE|DIR   # other files (no allow-list, no stale check)

Not here: what travels at run time (the codec refuses unknown types: ``treadle.common.codec``).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PICKLE_MODULES = frozenset({"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib",
                            "jsonpickle", "copyreg"})
MP_MODULES = frozenset({"multiprocessing", "torch.multiprocessing"})
MP_OBJECTS = frozenset({"Pipe", "Queue", "SimpleQueue", "JoinableQueue", "Manager", "Listener", "Client"})
SAFE_YAML_LOADERS = frozenset({"SafeLoader", "CSafeLoader"})

ALLOWED: dict[tuple[str, str], str] = {
    ("integration/src/treadle/integration/ray_backend.py", "ray"):
        "the launcher's Ray actors: Ray pickles their calls (Ray's business, inside a Ray cluster the "
        "user runs); the arguments are strings, ints and paths, and treadle's own data never rides "
        "on Ray: daemons talk over the msgpack wire",
    ("packages/rollout/src/treadle/rollout/ray_engines.py", "ray"):
        "the rollout daemon's engine actors (--engine_placement ray): Ray pickles their calls inside "
        "the Ray cluster the user runs; the arguments are a JSON worker spec, environment strings "
        "and the engine's CURVE server keys as z85 text (Ray's channels are the cluster's trust "
        "boundary, as for any Ray job), and samples and weights never ride on Ray: the engines talk "
        "to the daemon over the msgpack wire, CURVE-encrypted",
    ("packages/trainer/src/treadle/trainer/trainers/critic.py", "checkpoint-load"):
        "the critic server's DeepSpeed checkpoint: torch.load of files the run's critic wrote in the "
        "run's --ckpt.path (a folder outside it is refused), at a path its authenticated trainer names",
    ("packages/trainer/src/treadle/trainer/checkpoint/checkpointer.py", "checkpoint-load"):
        "DeepSpeed's own checkpoint format: torch.load of files this run wrote under --ckpt.path on "
        "local disk, never bytes from a peer",
}


@dataclass(frozen=True, slots=True)
class Finding:
    path: str
    line: int
    rule: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.what}"


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a Name/Attribute chain, else ""."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted module or object it stands for (``np`` -> ``numpy``)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _resolve(node: ast.AST, aliases: dict[str, str]) -> str:
    name = _dotted(node)
    head, _, rest = name.partition(".")
    full = aliases.get(head, head)
    return f"{full}.{rest}" if rest else full


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _import_findings(node: ast.AST) -> list[tuple[str, str]]:
    names = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    out = []
    for name in names:
        if name.split(".")[0] in PICKLE_MODULES:
            out.append(("pickle-module", f"imports {name}"))
        elif any(name.startswith(f"{m}.{sub}") for m in MP_MODULES for sub in ("connection", "managers")) or \
                any(name == f"{m}.{o}" for m in MP_MODULES for o in MP_OBJECTS):
            out.append(("mp-connection", f"imports {name} (pickles what it carries)"))
    return out


def _call_findings(call: ast.Call, aliases: dict[str, str]) -> list[tuple[str, str]]:
    out = []
    name = _resolve(call.func, aliases)
    allow = _kw(call, "allow_pickle")
    if allow is not None and not _is_const(allow, False):
        out.append(("numpy-allow-pickle", f"{name or 'a call'}(allow_pickle={ast.unparse(allow)})"))
    if name == "torch.load" and not _is_const(_kw(call, "weights_only"), True):
        out.append(("torch-load", "torch.load without weights_only=True"))
    if name == "yaml.unsafe_load" or (name == "yaml.load" and not any(
            _dotted(n).split(".")[-1] in SAFE_YAML_LOADERS for n in [*call.args[1:], _kw(call, "Loader")] if n)):
        out.append(("yaml-unsafe", f"{name} without a SafeLoader"))
    if name.split(".")[0] in PICKLE_MODULES and name.count("."):
        out.append(("pickle-module", f"{name}(...)"))
    if name in ("__import__", "importlib.import_module") and call.args and isinstance(call.args[0], ast.Constant) \
            and str(call.args[0].value).split(".")[0] in PICKLE_MODULES:
        out.append(("pickle-module", f"{name}({call.args[0].value!r})"))
    if name in ("ray.put", "ray.get") or (isinstance(call.func, ast.Attribute) and call.func.attr == "remote"):
        out.append(("ray", f"{name or ast.unparse(call.func)}(...) (Ray moves its arguments with cloudpickle)"))
    if isinstance(call.func, ast.Attribute):
        owner = call.func.value
        owner_name = _resolve(owner.func if isinstance(owner, ast.Call) else owner, aliases)
        if call.func.attr in MP_OBJECTS and (owner_name in MP_MODULES or owner_name.endswith("get_context")):
            out.append(("mp-connection", f"{owner_name}.{call.func.attr}() (pickles what it carries)"))
        if call.func.attr == "load_checkpoint":
            out.append(("checkpoint-load", f"{ast.unparse(call.func)}(...) (torch.load inside)"))
    return out


def check_source(text: str, path: str) -> list[Finding]:
    """Findings in one module's source (``path`` only labels them)."""
    tree = ast.parse(text, filename=path)
    aliases = _aliases(tree)
    found: list[Finding] = []
    for node in ast.walk(tree):
        pairs = _import_findings(node)
        if isinstance(node, ast.Call):
            pairs += _call_findings(node, aliases)
        found += [Finding(path, node.lineno, rule, what) for rule, what in pairs]
    return sorted(set(found), key=lambda f: (f.path, f.line, f.rule))


def source_files(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def default_roots() -> list[Path]:
    return sorted((ROOT / "packages").glob("*/src")) + [ROOT / "integration" / "src"]


def _label(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def run(paths: list[Path], allowed: dict[tuple[str, str], str]) -> tuple[list[Finding], list[Finding], list[str]]:
    """(findings not allowed, findings allowed, stale allow-list entries) over ``paths``."""
    bad, ok, used = [], [], set()
    for path in source_files(paths):
        for f in check_source(path.read_text(encoding="utf-8"), _label(path)):
            if (f.path, f.rule) in allowed:
                ok.append(f)
                used.add((f.path, f.rule))
            else:
                bad.append(f)
    stale = [f"{p}: [{rule}] allow-list entry matches nothing: remove it" for p, rule in allowed if (p, rule) not in used]
    return bad, ok, stale


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    repo = not args
    paths = default_roots() if repo else [Path(a) for a in args]
    bad, ok, stale = run(paths, ALLOWED if repo else {})
    for f in bad:
        print(f)
    for (path, rule), reason in ALLOWED.items():
        lines = [str(f.line) for f in ok if (f.path, f.rule) == (path, rule)]
        if lines:
            print(f"allowed: {path}:{','.join(lines)}: [{rule}] {reason}")
    stale = stale if repo else []
    for line in stale:
        print(line)
    print(f"check_no_pickle: {len(source_files(paths))} files, {len(bad)} finding(s), {len(ok)} allowed, "
          f"{len(stale)} stale allow-list entr{'y' if len(stale) == 1 else 'ies'}")
    return 1 if bad or stale else 0


if __name__ == "__main__":
    sys.exit(main())
