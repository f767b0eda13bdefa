# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Real ansible-playbook runs on localhost with the kv_profile and kv_plan action plugins."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import procgroup  # noqa: E402  pylint: disable=wrong-import-position,import-error
import pytest

REPO = Path(__file__).resolve().parents[2]
PLAYBOOK = REPO / "tests" / "integration" / "playbooks" / "kv_actions.yml"
GIB = 1024**3


def _collections_path(tmp_root: Path) -> str:
    linked = REPO / ".cache" / "collections"
    if (linked / "ansible_collections" / "gpufleet" / "vllm").exists():
        return str(linked)
    target = tmp_root / "collections" / "ansible_collections" / "gpufleet"
    target.mkdir(parents=True)
    (target / "vllm").symlink_to(REPO)
    return str(tmp_root / "collections")


def _inventory(path: Path) -> Path:
    def gpu(index: int, free: int) -> dict:
        return {
            "index": index,
            "name": "NVIDIA H200",
            "total_bytes": 141 * GIB,
            "free_bytes": free,
            "boot_free_bytes": free,
            "free_min_bytes": free,
            "free_max_bytes": free,
        }

    inventory = {
        "all": {
            "hosts": {"localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}},
            "children": {
                "h200": {
                    "hosts": {
                        "gpu-a": {"gpufleet_gpus": [gpu(0, 42 * GIB), gpu(1, int(40.75 * GIB))]},
                        "gpu-b": {"gpufleet_gpus": [gpu(0, 42 * GIB), gpu(1, 42 * GIB)]},
                    }
                }
            },
        }
    }
    path.write_text(json.dumps(inventory))
    return path


def _playbook(tmp_path: Path, store: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(
        ANSIBLE_COLLECTIONS_PATH=_collections_path(tmp_path),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "ansible-tmp"),
        ANSIBLE_RETRY_FILES_ENABLED="0",
    )
    playbook = shutil.which("ansible-playbook", path=os.path.dirname(sys.executable)) or shutil.which("ansible-playbook")
    assert playbook, "ansible-playbook not found"
    cmd = [playbook, "-i", str(_inventory(tmp_path / "inventory.json")), str(PLAYBOOK), "-e", f"kv_store={store}", "-e", f"kv_out={out}", *extra]
    return procgroup.run(cmd, env=env, timeout=300)


def _store_files(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*.yml")) if store.exists() else []


@pytest.fixture
def dirs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    return tmp_path / "store", out


def test_record_query_and_plan(tmp_path, dirs):
    store, out = dirs
    proc = _playbook(tmp_path, store, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    files = _store_files(store)
    assert len(files) == 1
    assert results["rec"]["changed"] is True
    assert results["rec"]["record"]["path"] == str(files[0])
    assert results["q1"]["profile"]["path"] == str(files[0])
    plan = results["plan"]
    assert plan["kv_cache_memory_bytes"] == 30333206528
    assert plan["free_floor_bytes"] == {"0": int(40.75 * GIB), "1": int(40.75 * GIB)}
    assert plan["utilization_source"] == "vllm"
    assert 0 < plan["gpu_memory_utilization"] < 1
    assert plan["num_blocks"] == 14464 and plan["kv_cache_tokens"] == 14464 * 16
    assert plan["admission"]["ok"] is True
    assert {(r["host"], r["rank"]) for r in plan["per_rank"]} == {("gpu-a/vllm", 0), ("gpu-a/vllm", 1), ("gpu-b/vllm", 0), ("gpu-b/vllm", 1)}
    assert results["none"]["decision"] == "refuse"
    assert results["fit"]["fit"]["left_free_bytes_per_gpu"] == 30333206528 - results["fit"]["kv_cache_memory_bytes"]

    # a second run records a second file and never touches the first
    first = files[0].read_bytes()
    proc = _playbook(tmp_path, store, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(_store_files(store)) == 2
    assert files[0].read_bytes() == first


def test_check_mode_records_nothing(tmp_path, dirs):
    store, out = dirs
    proc = _playbook(tmp_path, store, out, "--check", "--diff")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _store_files(store) == []
    results = json.loads((out / "results.json").read_text())
    assert results["rec"]["changed"] is True
    assert results["rec"]["record"]["path"] is None
    assert "kv_bytes: 32212254720" in proc.stdout  # the diff of the would-be file
    assert results["plan"]["decision"] == "refuse"  # nothing recorded, so no reference to plan from


def test_corrupt_store_file_is_reported_and_kept(tmp_path, dirs):
    store, out = dirs
    proc = _playbook(tmp_path, store, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (good,) = _store_files(store)
    bad = good.parent / "h200--0123456789abcdef--20991231T235959000000Z--0badf11e.yml"
    bad.write_text("format: 1\nprofile: {ranks: [\n")
    proc = _playbook(tmp_path, store, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "unreadable profile skipped" in text
    assert bad.name in text
    results = json.loads((out / "results.json").read_text())
    assert results["q1"]["status"] == "found"
    assert results["q1"]["corrupt"][0]["path"] == str(bad)
    assert bad.read_text() == "format: 1\nprofile: {ranks: [\n"
    assert results["plan"]["decision"] == "deploy"
