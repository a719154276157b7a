"""No module-level mutable state in the packages (tests/architecture/rules.py says what counts)."""

from __future__ import annotations

import ast
import textwrap

import pytest

from tests.architecture.rules import module_state

# Offences that predate this check, in packages being restructured; each goes when its module is reworked
# (an entry that no longer matches fails below, so the list only shrinks). (path, key), line-independent.
KNOWN = frozenset({
    ("packages/mg-models/src/mg_models/pretrained.py", "global _entry_point_errors"),
    ("packages/mg-models/src/mg_models/pretrained.py", "mutated MG_CHECKPOINT_LOADERS"),
    ("packages/mg-parallel/src/mg_parallel/context_parallel/blocks.py", "mutated _FLASH_CUDA_EMPTY"),
    ("packages/mg-parallel/src/mg_parallel/context_parallel/blocks.py", "mutated _FLASH_CUDA_OK"),
    ("packages/mg-parallel/src/mg_parallel/moe/experts.py", "mutated _PROBED"),
    ("packages/mg-parallel/src/mg_parallel/optimizer/adamw.py", "mutated _FUSED_OK"),
    ("packages/mg-parallel/src/mg_parallel/pipeline/p2p.py", "mutated _READY_GROUPS"),
    ("packages/mg-parallel/src/mg_parallel/testing.py", "mutated _POOLS"),
    ("packages/mg-parallel/src/mg_parallel/testing.py", "atexit.register"),
})


def keys(source: str) -> list[str]:
    return [o.key for o in module_state("m.py", ast.parse(textwrap.dedent(source)))]


def test_the_packages_keep_no_module_state(sources):
    found = [o for path, tree in sources for o in module_state(path, tree)]
    new = [str(o) for o in found if (o.path, o.key) not in KNOWN]
    if new:
        pytest.fail("module-level mutable state:\n" + "\n".join(new), pytrace=False)
    stale = sorted(KNOWN - {(o.path, o.key) for o in found})
    if stale:
        pytest.fail(f"no longer found, remove from KNOWN in tests/architecture/test_module_state.py: {stale}",
                    pytrace=False)


@pytest.mark.parametrize(("source", "expected"), [
    ("_N = 0\ndef f():\n    global _N\n    _N += 1\n", ["global _N"]),
    ("_SEEN = set()\ndef f(x):\n    _SEEN.add(x)\n", ["mutated _SEEN"]),
    ("_CACHE: dict[str, int] = {}\ndef f(k):\n    _CACHE[k] = 1\n", ["mutated _CACHE"]),
    ("_CACHE = {}\ndef f(k):\n    del _CACHE[k]\n", ["mutated _CACHE"]),
    ("import collections\n_BY = collections.defaultdict(list)\ndef f(k, v):\n    _BY[k].append(v)\n",
     ["mutated _BY"]),
    ("from collections import deque\n_Q = deque()\ndef f(x):\n    _Q.appendleft(x)\n", ["mutated _Q"]),
    ("TABLE = {1: 2}\nfor k in (3, 4):\n    TABLE[k] = k\n", ["mutated TABLE"]),  # built at import in steps
    ("NAMES = ['a']\nNAMES += ['b']\n", ["mutated NAMES"]),
    ("A, B = [], {}\ndef f():\n    B.update(x=1)\n", ["mutated B"]),
    ("registry = {'a': 1}\n", ["lowercase registry"]),
    ("import threading\n_TLS = threading.local()\n", ["state _TLS"]),
    ("import itertools\n_IDS = itertools.count()\n", ["state _IDS"]),
    ("import atexit\ndef bye():\n    pass\natexit.register(bye)\n", ["atexit.register"]),
    ("from atexit import register\n@register\ndef bye():\n    pass\n", ["atexit.register"]),
    ("import signal as sg\nsg.signal(sg.SIGTERM, sg.SIG_DFL)\n", ["signal.signal"]),
    ("import sys\nif True:\n    sys.setrecursionlimit(10_000)\n", ["sys.setrecursionlimit"]),
    ("import torch\nclass A:\n    torch.manual_seed(0)\n", ["torch.manual_seed"]),
    ("import os\nos.environ['X'] = '1'\n", ["assigns os.environ['X']"]),
    ("import torch\ntorch.backends.cudnn.benchmark = True\n", ["assigns torch.backends.cudnn.benchmark"]),
])
def test_check_finds_module_state(source, expected):
    assert keys(source) == expected


@pytest.mark.parametrize("source", [
    "TABLE = {'a': 1, 'b': 2}\ndef f(k):\n    return TABLE[k]\n",  # a constant table, only read
    "TABLE = {'a': 1}\ndef f():\n    t = dict(TABLE)\n    t['b'] = 2\n    return t\n",  # a copy is the caller's
    "_SEEN = set()\ndef f(x):\n    _SEEN = set()\n    _SEEN.add(x)\n    return _SEEN\n",  # a local of the same name
    "_SEEN = set()\ndef f(_SEEN):\n    _SEEN.add(1)\n",  # a parameter of the same name
    "ITEMS = [1, 2]\ndef f():\n    return [ITEMS.append(0) for ITEMS in ([],)]\n",  # a comprehension's own name
    "import atexit\nclass Pool:\n    def __init__(self):\n        atexit.register(self.close)\n"
    "    def close(self):\n        pass\n",  # registered when the object that needs it is made
    "import signal\nHANDLER = lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)\n",  # runs when called
    "import os\ndef f():\n    os.environ['X'] = '1'\n",
    "_PATH = None\ndef f():\n    path = _PATH\n    return path\n",
    "__all__ = ['f']\ndef f():\n    pass\n",
])
def test_check_passes_code_without_module_state(source):
    assert keys(source) == []
