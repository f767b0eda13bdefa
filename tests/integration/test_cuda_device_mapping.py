# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Units select GPUs by UUID: each supported vLLM release's own device mapping, on NVML.

The unit sets ``CUDA_VISIBLE_DEVICES`` to the instance's cards by UUID
(``_launch.cuda_visible_devices``). The CPU build cannot show what the CUDA build does with
that value, so this runs the CUDA platform's own code of every release in
``SUPPORTED_WHEELS`` (``Platform.device_id_to_physical_device_id`` and
``NvmlCudaPlatform.device_control_id_to_physical_device_id``, read from the release's sources
with :mod:`ast`, prepared by ``make vllm-sources``) with the real ``pynvml`` against the fake
``libnvidia-ml.so.1``, in a fresh process per case (the library is found at load time).

Cases: the planned enumeration (rank r is the planned card), the same cards enumerated anew
after a reboot (the UUIDs still name the planned cards, while the indices the unit used to
carry would name other cards), and a planned card gone (NVML answers not found: the engine
does not start on another card).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_release import SUPPORTED_WHEELS
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import cuda_visible_devices

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUFLEET_CACHE") or REPO / ".cache")
SOURCES = CACHE / "vllm-sources"
sys.path.insert(0, str(REPO / "tests" / "fake_nvml"))
import nvml_state  # noqa: E402

GIB = 1024**3
UUIDS = [f"GPU-6f0c2a7e-0000-4000-8000-00000000000{i}" for i in range(4)]


def _method_source(path: Path, class_name: str, method: str) -> str:
    """The source of ``class_name.method`` in ``path``, dedented, without its decorators."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    item.decorator_list = []
                    return ast.unparse(item)
    raise AssertionError(f"{class_name}.{method} not found in {path}")


def release_mapping(version: str) -> str:
    """A script that maps each local device of ``CUDA_VISIBLE_DEVICES`` to an NVML index with the release's code."""
    platforms = SOURCES / version / "vllm" / "platforms"
    if not (platforms / "cuda.py").is_file():
        pytest.fail(f"the Python sources of vLLM {version} are not at {SOURCES / version}: run `make vllm-sources`")
    to_physical = _method_source(platforms / "interface.py", "Platform", "device_id_to_physical_device_id")
    control = _method_source(platforms / "cuda.py", "NvmlCudaPlatform", "device_control_id_to_physical_device_id")
    assert "device_control_id_to_physical_device_id" in to_physical, f"vLLM {version} maps devices another way: read its code again"
    assert "nvmlDeviceGetHandleByUUID" in control, f"vLLM {version} no longer resolves UUIDs through NVML: read its code again"
    return "\n".join([
        "import json, os, sys",
        "import pynvml",
        "_assigned_physical_gpu_ids = None",
        "class Platform:",
        "    device_control_env_var = 'CUDA_VISIBLE_DEVICES'",
        "    device_name = 'cuda'",
        textwrap.indent("@classmethod\n" + to_physical, "    "),
        textwrap.indent("@classmethod\n" + control, "    "),
        "pynvml.nvmlInit()",
        "out = []",
        "for local in range(len(os.environ['CUDA_VISIBLE_DEVICES'].split(','))):",
        "    try:",
        "        index = Platform.device_id_to_physical_device_id(local)",
        "        handle = pynvml.nvmlDeviceGetHandleByIndex(index)",
        "        out.append({'index': index, 'uuid': pynvml.nvmlDeviceGetUUID(handle)})",
        "    except pynvml.NVMLError as exc:",
        "        out.append({'error': str(exc)})",
        "print(json.dumps(out))",
    ])


def write_state(path: Path, order: list[int]) -> None:
    """Four H200s; ``order[i]`` is which card (0-3, by UUID) the driver enumerates at index i."""
    state = nvml_state.new_state()
    for index, card in enumerate(order):
        state["gpus"].append(nvml_state.make_gpu(index, 141 * GIB, uuid=UUIDS[card], pci=f"00000000:{0x18 + card:02x}:00.0"))
    nvml_state.save(str(path), state)


def engine_devices(version: str, state: Path, visible: str) -> list[dict[str, object]]:
    library = CACHE / "fake-nvml" / "libnvidia-ml.so.1"
    assert library.is_file(), f"{library} is missing: the fake NVML library is built by make test's setup"
    env = dict(os.environ, LD_LIBRARY_PATH=str(library.parent), FAKE_NVML_STATE=str(state), CUDA_VISIBLE_DEVICES=visible)
    proc = subprocess.run([sys.executable, "-c", release_mapping(version)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("version", SUPPORTED_WHEELS)
def test_units_name_the_planned_cards_in_every_enumeration(version: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    planned = [{"index": i, "uuid": UUIDS[i]} for i in range(4)]
    visible = cuda_visible_devices([2, 3], planned)
    assert visible == f"{UUIDS[2]},{UUIDS[3]}"

    write_state(state, [0, 1, 2, 3])
    assert engine_devices(version, state, visible) == [{"index": 2, "uuid": UUIDS[2]}, {"index": 3, "uuid": UUIDS[3]}]

    # after a reboot card 1 is gone and the others moved up: by UUID the engine still gets cards 2 and 3,
    # while the indices a unit used to carry ("2,3") would give it card 3 and no card
    write_state(state, [0, 2, 3])
    assert engine_devices(version, state, visible) == [{"index": 1, "uuid": UUIDS[2]}, {"index": 2, "uuid": UUIDS[3]}]
    by_index = engine_devices(version, state, "2,3")
    assert by_index[0] == {"index": 2, "uuid": UUIDS[3]}, "the old index-based unit would start rank 0 on another card"

    # a planned card gone: NVML cannot find it, so vLLM cannot map the rank (it never takes another card)
    write_state(state, [0, 1, 3])
    devices = engine_devices(version, state, visible)
    assert "error" in devices[0] and "Not Found" in str(devices[0]["error"]), devices
    assert devices[1] == {"index": 2, "uuid": UUIDS[3]}


def test_indices_without_a_complete_probe() -> None:
    assert cuda_visible_devices([1, 0], None) == "1,0"
    assert cuda_visible_devices([1, 0], [{"index": 0, "uuid": UUIDS[0]}]) == "1,0", "one card without a UUID: indices for all"
    assert cuda_visible_devices([1, 0], [{"index": 0, "uuid": UUIDS[0]}, {"index": 1, "uuid": UUIDS[1]}]) == f"{UUIDS[1]},{UUIDS[0]}"
