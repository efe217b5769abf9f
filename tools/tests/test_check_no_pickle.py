"""tools/check_no_pickle.py: the repo passes; each rule fires on the code it is about and stays
quiet on its safe twin; findings name file and line; a stale allow-list entry is an error."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cnp(tool):
    return tool("check_no_pickle")


def test_the_repo_has_no_pickle_on_the_wire() -> None:
    out = subprocess.run([sys.executable, str(TOOLS / "check_no_pickle.py")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " 0 finding(s)" in out.stdout and "0 stale" in out.stdout


def test_pickle_loads_in_a_file_fails_and_names_the_lines(cnp, tmp_path, capsys) -> None:
    bad = tmp_path / "handler.py"
    bad.write_text("import json\nimport pickle\n\n\ndef on_message(frame):\n    return pickle.loads(frame)\n")
    assert cnp.main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}:2: [pickle-module] imports pickle" in out
    assert f"{bad}:6: [pickle-module] pickle.loads(...)" in out
    assert "1 files, 2 finding(s)" in out


RULES = [
    ("pickle-module", "import cloudpickle as cp\n", "import json\n"),
    ("pickle-module", "def f():\n    from dill import loads\n", "def f():\n    from json import loads\n"),
    ("pickle-module", "m = __import__('marshal')\n", "m = __import__('json')\n"),
    ("torch-load", "import torch\ntorch.load('w.pt')\n", "import torch\ntorch.load('w.pt', weights_only=True)\n"),
    ("torch-load", "from torch import load as tl\ntl('w.pt', weights_only=False)\n",
     "from torch import save as tl\ntl(1, 'w.pt')\n"),
    ("numpy-allow-pickle", "import numpy as np\nnp.load('a.npy', allow_pickle=True)\n",
     "import numpy as np\nnp.load('a.npy', allow_pickle=False)\n"),
    ("mp-connection", "import multiprocessing as mp\nq = mp.Queue()\n", "import asyncio\nq = asyncio.Queue()\n"),
    ("mp-connection", "import torch.multiprocessing as tmp\na, b = tmp.get_context('spawn').Pipe()\n",
     "import queue\nq = queue.Queue()\n"),
    ("mp-connection", "from multiprocessing.connection import Listener\n", "from multiprocessing import cpu_count\n"),
    ("yaml-unsafe", "import yaml\nyaml.load(text)\n", "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)\n"),
    ("ray", "import ray\nray.get(actor.run.remote(1))\n", "import ray\nray.init()\n"),
    ("checkpoint-load", "engine.load_checkpoint('ckpt')\n", "engine.save_checkpoint('ckpt')\n"),
]


@pytest.mark.parametrize(("rule", "unsafe", "safe"), RULES, ids=[f"{r[0]}-{i}" for i, r in enumerate(RULES)])
def test_each_rule_fires_on_its_case_and_not_on_the_safe_twin(cnp, rule, unsafe, safe) -> None:
    found = cnp.check_source(textwrap.dedent(unsafe), "x.py")
    assert rule in {f.rule for f in found}, found
    assert all(f.path == "x.py" and f.line >= 1 for f in found)
    assert cnp.check_source(textwrap.dedent(safe), "x.py") == []


def test_allow_list_entries_allow_by_file_and_rule_and_stale_ones_are_reported(cnp, tmp_path) -> None:
    src = tmp_path / "local.py"
    src.write_text("import torch\ntorch.load('mine.pt')\n")
    label = cnp._label(src)
    bad, ok, stale = cnp.run([tmp_path], {(label, "torch-load"): "local file", (label, "ray"): "gone"})
    assert bad == [] and [f.line for f in ok] == [2]
    assert stale == [f"{label}: [ray] allow-list entry matches nothing: remove it"]
