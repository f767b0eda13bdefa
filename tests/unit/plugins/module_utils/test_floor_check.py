# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The free-memory floor check both gates use, and the boot gate's installed modules being self-contained."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

from ansible_collections.gpufleet.vllm.plugins.module_utils._gate import _boot_gate, _floor_check, _free_memory_gate
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan import _launch

ROOT = Path(__file__).resolve().parents[4]
GIB = 1 << 30
READING = [{"index": 0, "total_bytes": 48 * GIB, "boot_free_bytes": 41 * GIB, "uuid": "GPU-a", "pci_bus_id": "00000000:01:00.0"},
           {"index": 1, "total_bytes": 48 * GIB, "free_bytes": 38 * GIB, "health": {"ecc_mode": True}},
           {"index": 3, "total_bytes": 48 * GIB, "boot_free_bytes": 30 * GIB}]


def test_rows_give_each_rank_its_gpu_free_memory_floor_and_margin():
    rows = _floor_check.floor_rows([0, "1", 2], READING, {"0": 40 * GIB, 1: 40 * GIB, 2: 40 * GIB})
    assert rows[0] == {"rank": 0, "gpu": 0, "floor_bytes": 40 * GIB, "free_bytes": 41 * GIB, "total_bytes": 48 * GIB,
                       "margin_bytes": GIB, "uuid": "GPU-a", "pci_bus_id": "00000000:01:00.0"}
    # free_bytes stands in for a reading without boot_free_bytes; health comes along when read
    assert rows[1]["free_bytes"] == 38 * GIB and rows[1]["margin_bytes"] == -2 * GIB and rows[1]["health"] == {"ecc_mode": True}
    # GPU 2 is not in the reading: no free memory, no margin
    assert rows[2] == {"rank": 2, "gpu": 2, "floor_bytes": 40 * GIB, "free_bytes": None, "total_bytes": None, "margin_bytes": None}


def test_below_floor_and_shortfall_name_the_ranks_under_their_floor_and_by_how_much():
    rows = _floor_check.floor_rows([0, 1, 3], READING, {0: 40 * GIB, 1: 40 * GIB})
    assert rows[2]["floor_bytes"] is None and rows[2]["margin_bytes"] is None  # no floor for rank 2
    assert [r["rank"] for r in _floor_check.below_floor(rows)] == [1]
    assert _floor_check.shortfall(rows) == 2 * GIB
    above = _floor_check.floor_rows([0], READING, {0: 40 * GIB})
    assert _floor_check.below_floor(above) == [] and _floor_check.shortfall(above) == 0
    exact = _floor_check.floor_rows([0], READING, {0: 41 * GIB})
    assert _floor_check.below_floor(exact) == [] and exact[0]["margin_bytes"] == 0


def test_rank_floor_reads_int_and_str_keys():
    assert _floor_check.rank_floor({"1": "7"}, 1) == 7
    assert _floor_check.rank_floor({1: 5, "1": 7}, 1) == 5
    assert _floor_check.rank_floor({0: 5}, 1) is None


def test_both_gates_find_the_same_ranks_below_their_floor():
    launch = _launch.for_instance({"decision": "deploy", "kv_cache_memory_bytes": 20 * GIB, "gpu_memory_utilization": 0.5,
                                   "free_floor_bytes": {"0": 40 * GIB, "1": 40 * GIB}}, 0.9)
    reading = [{"index": 0, "total_bytes": 48 * GIB, "boot_free_bytes": 41 * GIB},
               {"index": 1, "total_bytes": 48 * GIB, "boot_free_bytes": 38 * GIB}]
    found = _free_memory_gate.gate_violations(reading, [{"name": "main", "gpus": [0, 1]}], launch)
    assert len(found) == 1 and found[0].startswith(f"main rank 1 (GPU 1): boot-free {38 * GIB} B")
    plan = {"gpus": [0, 1], "free_floor_bytes": {0: 40 * GIB, 1: 40 * GIB}}
    assert [r["rank"] for r in _floor_check.below_floor(_boot_gate.rank_rows(plan, reading))] == [1]


MODULE_UTILS = ROOT / "plugins/module_utils"


def _relative_imports(path: Path) -> set[str]:
    """The module_utils files (paths under plugins/module_utils) a file imports relatively, from
    its own folder or, with ``..``, from a sibling subpackage."""
    files: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.ImportFrom) and node.level):
            continue
        base = path.parent
        base = base.parents[node.level - 2] if node.level > 1 else base
        target = base.joinpath(*node.module.split(".")) if node.module else base
        if target.is_dir():  # from .._gpu import _nvml_probe, from .. import _validate
            files.update(target / f"{alias.name}.py" for alias in node.names)
        else:
            files.add(target.parent / f"{target.name}.py")
    return {p.relative_to(MODULE_UTILS).as_posix() for p in files}


def test_the_boot_gates_installed_modules_import_only_each_other():
    """vllm_service installs these module_utils files as a package of their own on the host: every module
    one of them imports must be installed too, and the __init__.py of every subpackage they lie in, or
    the gate fails at the unit's start."""
    shipped = yaml.safe_load((ROOT / "roles/vllm_service/vars/main.yml").read_text(encoding="utf-8"))["__vllm_service_gate_modules"]
    assert "_gate/_boot_gate.py" in shipped and "_gate/_floor_check.py" in shipped
    for name in shipped:
        missing = _relative_imports(MODULE_UTILS / name) - set(shipped)
        assert not missing, f"{name} imports {sorted(missing)}, which the gate does not install"
        package = Path(name).parent
        assert package == Path(".") or (package / "__init__.py").as_posix() in shipped, f"{name}: its package's __init__.py is not installed"
