# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fake NVML state file reader/writer."""
from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from ansible_collections.gpufleet.vllm.tests.fake_nvml import nvml_state


def sample_state():
    state = nvml_state.new_state()
    state["system"]["missing"] = ["nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetPciInfo_v3"]
    state["gpus"] = [nvml_state.make_gpu(1, 100, name="A B,C%D", noise=[1, 2, 3], free_override=7),
                     nvml_state.make_gpu(0, 200, reserved=5, error=15, cc="8.9")]
    nvml_state.add_process(state, gpu=1, pid=9, used=10, kind="both", name="py thon")
    return state


def test_round_trip(tmp_path):
    path = tmp_path / "state"
    state = sample_state()
    nvml_state.save(path, state)
    loaded = nvml_state.load(path)
    assert [g["index"] for g in loaded["gpus"]] == [0, 1]
    gpu1 = loaded["gpus"][1]
    assert gpu1["name"] == "A B,C%D" and gpu1["noise"] == [1, 2, 3] and gpu1["free_override"] == 7
    assert loaded["gpus"][0]["error"] == 15 and loaded["gpus"][0]["cc"] == "8.9"
    assert loaded["system"]["missing"] == ["nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetPciInfo_v3"]
    assert loaded["procs"] == [{"gpu": 1, "pid": 9, "used": 10, "kind": "both", "name": "py thon"}]
    assert nvml_state.dumps(loaded) == nvml_state.dumps(state)
    assert "name=A%20B%2CC%25D" in path.read_text()


def test_reads_the_documented_example():
    text = (
        "# comment\n"
        "system driver=550.127.05 cuda=12040 nvml=12.550.127.05 init_error=0 missing=\n"
        "gpu index=0 uuid=GPU-6f0c name=NVIDIA%20H200 pci=00000000:18:00.0 total=150754820096 "
        "reserved=566231040 base_used=0 cc=9.0 error=0 noise=\n"
        "proc gpu=0 pid=4242 used=1073741824 kind=compute name=python3   # trailing comment\n"
        "future record=ignored\n"
    )
    state = nvml_state.loads(text)
    assert state["gpus"][0]["name"] == "NVIDIA H200" and state["gpus"][0]["noise"] == []
    assert state["procs"][0]["pid"] == 4242


@pytest.mark.parametrize(("text", "message"), [
    ("gpu total=1\n", "without index"),
    ("gpu index=1 total=1\n", "indices must be 0..0"),
    ("gpu index=0 total=x\n", "total: 'x' is not an integer"),
    ("gpu index=0 total=1\nproc gpu=3 pid=1 used=1\n", "no GPU with index 3"),
    ("gpu index=0 total=1\nproc gpu=0 pid=1 used=1 kind=video\n", "kind"),
    ("gpu index=0 total=1\nproc gpu=0 used=1\n", "without pid"),
    ("system driver\n", "is not key=value"),
    ("gpu index=0 total=1 cc=9\n", "MAJOR.MINOR"),
])
def test_malformed(text, message):
    with pytest.raises(nvml_state.StateError, match=message):
        nvml_state.loads(text, source="f")


def test_save_is_atomic_and_refuses_bad_state(tmp_path):
    path = tmp_path / "sub" / "state"
    nvml_state.save(path, sample_state(), mode=0o600)
    before = path.read_text()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    bad = sample_state()
    bad["procs"][0]["used"] = -1
    with pytest.raises(nvml_state.StateError, match=r"procs\[0\].used"):
        nvml_state.save(path, bad)
    assert path.read_text() == before
    assert sorted(os.listdir(path.parent)) == ["state"]


def test_locked_serialises_writers(tmp_path):
    path = tmp_path / "state"
    nvml_state.save(path, sample_state())

    def bump(pid: int) -> None:
        with nvml_state.locked(path):
            state = nvml_state.load(path)
            time.sleep(0.01)
            nvml_state.add_process(state, gpu=0, pid=pid, used=1)
            nvml_state.save(path, state)

    threads = [threading.Thread(target=bump, args=(100 + i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pids = sorted(p["pid"] for p in nvml_state.load(path)["procs"])
    assert pids == [9] + list(range(100, 108))
    assert nvml_state.remove_processes(nvml_state.load(path), {100, 101}) == 2


def test_default_path(monkeypatch):
    monkeypatch.delenv("FAKE_NVML_STATE", raising=False)
    assert nvml_state.default_path() == "/etc/fake-nvml/state"
    monkeypatch.setenv("FAKE_NVML_STATE", "/x/y")
    assert nvml_state.default_path() == "/x/y"


def test_cli_validates(tmp_path, capsys):
    path = tmp_path / "state"
    nvml_state.save(path, sample_state())
    assert nvml_state.main([str(path)]) == 0
    assert "proc gpu=1 pid=9" in capsys.readouterr().out
    path.write_text("gpu index=3 total=1\n")
    assert nvml_state.main([str(path)]) == 1
    assert "indices must be" in capsys.readouterr().err


def test_list_values_with_encoded_commas_are_read():
    state = nvml_state.loads("system missing=nvmlA%2CnvmlB\ngpu index=0 total=10 noise=1%2C2\n")
    assert state["system"]["missing"] == ["nvmlA", "nvmlB"]
    assert state["gpus"][0]["noise"] == [1, 2]
    bad = nvml_state.new_state()
    bad["system"]["missing"] = ["a,b"]
    with pytest.raises(nvml_state.StateError, match="must not contain"):
        nvml_state.dumps(bad)


def test_health_keys_round_trip_and_are_written_only_when_set():
    state = nvml_state.new_state()
    sick = nvml_state.make_gpu(1, 1 << 30, remap_pending=1, ecc_mode=0, xid=[79, 48], unsupported=["nvmlDeviceGetRetiredPagesPendingStatus"])
    state["gpus"] = [nvml_state.make_gpu(0, 1 << 30), sick]
    text = nvml_state.dumps(state)
    first, second = [line for line in text.splitlines() if line.startswith("gpu ")]
    assert "remap" not in first and "xid" not in first and "ecc" not in first
    assert "remap_pending=1" in second and "ecc_mode=0" in second and "xid=79,48" in second
    assert "unsupported=nvmlDeviceGetRetiredPagesPendingStatus" in second
    back = nvml_state.loads(text)
    assert back["gpus"][1]["xid"] == [79, 48] and back["gpus"][1]["remap_pending"] == 1
    assert back["gpus"][0]["ecc_mode"] == 1 and back["gpus"][0]["unsupported"] == []


@pytest.mark.parametrize("field, value, needle", [
    ("xid", [-1], "xid: expected a list of non-negative integers"),
    ("unsupported", ["a,b"], "unsupported: expected a list of NVML function names"),
    ("remap_pending", True, "remap_pending: expected a non-negative integer"),
])
def test_bad_health_keys_name_the_field(field, value, needle):
    state = nvml_state.new_state()
    state["gpus"] = [nvml_state.make_gpu(0, 1 << 30, **{field: value})]
    with pytest.raises(nvml_state.StateError, match=needle):
        nvml_state.dumps(state)
