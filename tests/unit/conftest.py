"""Make the collection importable as ``ansible_collections.gpufleet.vllm`` for pytest.

``make units`` puts ``.cache/collections`` (a symlink tree made by ``make collection-link``)
on ``PYTHONPATH``. When pytest is started some other way (an editor, a bare ``pytest``)
and the import path is missing, an equivalent symlink tree is created in a temporary
directory for the session.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _collection_importable() -> bool:
    try:
        spec = importlib.util.find_spec("ansible_collections.gpufleet.vllm")
    except ModuleNotFoundError:
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(Path(p).resolve() == REPO_ROOT for p in spec.submodule_search_locations)


def _link_collection() -> None:
    tree = Path(tempfile.mkdtemp(prefix="gpufleet-vllm-collections-"))
    atexit.register(shutil.rmtree, tree, True)
    namespace = tree / "ansible_collections" / "gpufleet"
    namespace.mkdir(parents=True)
    os.symlink(REPO_ROOT, namespace / "vllm")
    sys.path.insert(0, str(tree))
    importlib.invalidate_caches()
    for name in [m for m in sys.modules if m == "ansible_collections" or m.startswith("ansible_collections.")]:
        del sys.modules[name]


if not _collection_importable():
    _link_collection()
