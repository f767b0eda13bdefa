# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
"""vllm_host_snapshot: the probe, every instance's unit state and plan record, the interpreter, in one call."""
from __future__ import annotations

import json
import platform
import sys
from typing import Any

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpufleet.vllm.plugins.module_utils import _host_snapshot
from ansible_collections.gpufleet.vllm.plugins.module_utils._units import _instance
from ansible_collections.gpufleet.vllm.plugins.modules import gpu_memory_facts, vllm_host_snapshot
from ansible_collections.gpufleet.vllm.tests.unit.plugins.module_utils.test_nvml_probe import FakeNvml, make_state

UNITS = {
    "vllm-main.service": {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "MainPID": "0"},
    "vllm-side.service": {"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "MainPID": "0"},
}
NOT_FOUND = {"LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead", "MainPID": "0"}


class FakeSystemctl:
    """``systemctl show`` as the module runs it: the probe's one unit at a time, the snapshot's all at once."""

    def __init__(self, units: dict[str, dict[str, str]], rc: int = 0) -> None:
        self.units, self.rc, self.calls = units, rc, []

    def __call__(self, argv: Any, **_kwargs: Any) -> tuple[int, str, str]:
        argv = list(argv)
        self.calls.append(argv)
        assert argv[:2] == ["systemctl", "show"], argv
        if "-p" in argv:  # the probe: ControlGroup, MainPID, LoadState of one unit
            props = self.units.get(argv[-1], NOT_FOUND)
            return 0, f"ControlGroup=\nMainPID={props['MainPID']}\nLoadState={props['LoadState']}\n", ""
        if self.rc:
            return self.rc, "", "Failed to connect to bus: No such file or directory"
        wanted = argv[-1].split("=", 1)[1].split(",")
        names = [a for a in argv[2:] if not a.startswith("--")]
        blocks = ["\n".join(f"{k}={self.units.get(n, NOT_FOUND)[k]}" for k in wanted) for n in names]
        return 0, "\n\n".join(blocks) + "\n", ""


def run(monkeypatch, capsys, module: Any, args: dict[str, Any], systemctl: FakeSystemctl | None = None) -> tuple[int, dict[str, Any]]:
    monkeypatch.setattr(module, "pynvml", FakeNvml(make_state(2)))
    monkeypatch.setattr(platform, "node", lambda: "gpu-a1")
    fake = systemctl or FakeSystemctl(UNITS)
    monkeypatch.setattr(module.AnsibleModule, "run_command", lambda self, argv, **kw: fake(argv, **kw))
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        module.main()
    return exc.value.code or 0, json.loads(capsys.readouterr().out)


def test_one_call_reads_the_gpus_the_units_and_the_plan_records(monkeypatch, capsys, tmp_path):
    (tmp_path / "main.plan.json").write_text(json.dumps({"instance": "main", "kv_cache_memory_bytes": 8 << 30}))
    (tmp_path / "side.plan.json").write_text("{not json")
    systemctl = FakeSystemctl(UNITS)
    rc, out = run(monkeypatch, capsys, vllm_host_snapshot,
                  {"instances": ["main", "side", "new"], "state_dir": str(tmp_path), "samples": 2, "interval": 0}, systemctl)
    assert rc == 0 and out["changed"] is False
    assert [g["index"] for g in out["gpus"]] == [0, 1] and out["gpus"][0]["samples"] == 2
    assert out["interpreter"] == sys.executable
    assert [(i["name"], i["unit"], i["active_state"], i["unit_exists"]) for i in out["instances"]] == [
        ("main", "vllm-main.service", "active", True),
        ("side", "vllm-side.service", "failed", True),
        ("new", "vllm-new.service", "inactive", False)]
    # the plan record as parsed; an unparsable or missing one is empty (the canary then runs)
    assert [i["plan"] for i in out["instances"]] == [{"instance": "main", "kv_cache_memory_bytes": 8 << 30}, {}, {}]
    assert [i["plan_error"] for i in out["instances"]] == [None, None, None]
    # the units' states in one systemctl call, besides the probe's own reading of each unit's processes
    snapshot_calls = [c for c in systemctl.calls if "-p" not in c]
    assert snapshot_calls == [["systemctl", "show", "vllm-main.service", "vllm-side.service", "vllm-new.service",
                               "--property=LoadState,ActiveState,SubState"]]
    facts = out["ansible_facts"]
    assert facts["gpufleet_gpus"] == out["gpus"] and facts["gpufleet_nvml"]["host"] == "gpu-a1"
    assert facts["gpufleet_host_snapshot"] == {"host": "gpu-a1", "interpreter": sys.executable, "instances": out["instances"],
                                               "engine": None, "install_record": {}, "install_record_error": None}
    assert "engine" not in out  # no engine_executable: no runtime read
    assert out["install_record"] == {} and out["install_record_error"] is None  # no runtime_venv: no install record


def test_the_probe_part_is_gpu_memory_facts_with_the_instances_units_as_own(monkeypatch, capsys, tmp_path):
    args = {"samples": 1, "interval": 0}
    warned: list[str] = []
    for module in (vllm_host_snapshot, gpu_memory_facts):
        monkeypatch.setattr(module.AnsibleModule, "warn", lambda self, msg: warned.append(msg))
    rc_snap, snap = run(monkeypatch, capsys, vllm_host_snapshot,
                        dict(args, instances=["main"], adopt_units=["legacy.service"], state_dir=str(tmp_path)))
    rc_facts, facts = run(monkeypatch, capsys, gpu_memory_facts, dict(args, service_units=["vllm-main.service", "legacy.service"]))
    assert rc_snap == rc_facts == 0
    for key in ("gpus", "driver_version", "cuda_driver_version", "nvml_version", "own_pids"):
        assert snap[key] == facts[key], key
    # the unknown legacy unit is named by both, once each
    unknown = "gpu-a1: systemd unit 'legacy.service' not found: no process counts as own through it"
    assert [w for w in warned if "'legacy.service' not found" in w] == [unknown] * 2


@pytest.mark.parametrize(("args", "field"), [
    ({"instances": ["main", "bad\nname"]}, "instances[1]"),
    ({"instances": ["main", "main"]}, "instances[1]: 'main' is also instances[0]; names must be unique"),
    ({"state_dir": "relative/dir"}, "state_dir: must be an absolute path"),
    ({"state_dir": "/var/lib/gpufleet/../../etc"}, "state_dir: must not contain '..'"),
    ({"engine_executable": "venv/bin/vllm"}, "engine_executable: must be an absolute path"),
    ({"engine_executable": "/opt/vllm//bin/vllm"}, "engine_executable: must be a normalised path"),
    ({"runtime_venv": "opt/vllm/venv"}, "runtime_venv: must be an absolute path"),
    ({"runtime_venv": "/opt/vllm/venv\n"}, "runtime_venv:"),
    ({"adopt_units": ["ok.service", "x\x1b"]}, "adopt_units[1]"),
    ({"samples": 0}, "samples"),
    ({"model": "srv/models/m"}, "model: must be an absolute path (a local model)"),
    ({"model": "/srv/models/m\x07"}, "model:"),
    ({"model": "/srv/models/m", "model_user": "Bad User"}, "model_user:"),
    ({"resolve": ["leader one"]}, "resolve[0]: a host name or address has no whitespace"),
    ({"resolve": ["gpu-a1\n"]}, "resolve[0]:"),
])
def test_bad_input_names_the_field_and_reads_nothing(monkeypatch, capsys, args, field):
    systemctl = FakeSystemctl(UNITS)
    rc, out = run(monkeypatch, capsys, vllm_host_snapshot, args, systemctl)
    assert rc == 1 and out["msg"].startswith(field), out["msg"]
    assert systemctl.calls == []


def test_a_systemd_that_cannot_be_read_fails_naming_the_host(monkeypatch, capsys, tmp_path):
    rc, out = run(monkeypatch, capsys, vllm_host_snapshot, {"instances": ["main"], "state_dir": str(tmp_path)}, FakeSystemctl(UNITS, rc=1))
    assert rc == 1 and "ansible_facts" not in out
    assert out["msg"].startswith("gpu-a1: cannot read the units of the instances: systemctl show vllm-main.service failed (rc 1)")


def test_the_argument_spec_is_the_probes_plus_the_instances():
    from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._gpu_memory import ARGUMENT_SPEC as PROBE

    assert {k: v for k, v in _host_snapshot.ARGUMENT_SPEC.items() if k in PROBE} == PROBE
    own = {"instances", "adopt_units", "state_dir", "engine_executable", "runtime_venv", "model", "model_user", "resolve"}
    assert set(_host_snapshot.ARGUMENT_SPEC) - set(PROBE) == own


def test_unit_names_have_one_home():
    assert _instance.unit_name("main") == "vllm-main.service"
    assert _instance.unit_names(["a", "b"]) == ["vllm-a.service", "vllm-b.service"]
    assert _instance.instance_of_unit("vllm-main.service") == "main"
    assert _instance.instance_of_unit("vllm-.service") is None and _instance.instance_of_unit("other.service") is None
    assert _instance.env_file_name("main") == "vllm-main.env" and _instance.plan_file_name("main") == "main.plan.json"


RUNTIME_JSON = json.dumps({"python": "/opt/vllm/venv/bin/python", "base_python": "/usr/bin/python3.12", "purelib": "/x",
                           "distributions": {"vllm": "0.33.0", "torch": "2.9.0", "nvidia-nccl-cu12": "2.27.3"},
                           "files": {"torch/version.py": "__version__ = '2.9.0+cu128'\ncuda = '12.8'\n"}, "extensions": [], "library_dirs": []})


def fake_engine(tmp_path, python_script: str | None):
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "vllm").write_text("#!/bin/sh\necho 0.33.0\n")
    (bindir / "vllm").chmod(0o755)
    if python_script is not None:
        (bindir / "python").write_text(python_script)
        (bindir / "python").chmod(0o755)
    return str(bindir / "vllm")


def shell_runner(argv):
    """The module's runner: a program that cannot start is rc 127 and the reason."""
    import subprocess
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    except OSError as exc:
        return 127, "", str(exc)
    return done.returncode, done.stdout, done.stderr


def test_the_engine_runtime_is_the_runtime_info_modules_key_fields(tmp_path):
    (tmp_path / "runtime.json").write_text(RUNTIME_JSON)
    exe = fake_engine(tmp_path, f"#!/bin/sh\ncat {tmp_path}/runtime.json\n")
    engine = _host_snapshot.engine_runtime(exe, shell_runner)
    # the NCCL is beside compat: a key field of an instance that spans hosts only
    assert engine == {"executable": exe, "python": str(tmp_path / "venv" / "bin" / "python"), "error": None,
                      "compat": {"vllm_version": "0.33.0", "torch_version": "2.9.0", "cuda_version": "12.8"}, "nccl_version": "2.27.3"}


def test_an_engine_without_an_interpreter_has_nothing_to_read(tmp_path):
    engine = _host_snapshot.engine_runtime(fake_engine(tmp_path, None), shell_runner)
    assert engine["python"] is None and engine["compat"] == {} and engine["error"] is None


def test_an_interpreter_that_cannot_read_its_packages_is_named_not_fatal(tmp_path):
    exe = fake_engine(tmp_path, "#!/bin/sh\necho 'ModuleNotFoundError: importlib' >&2\nexit 3\n")
    engine = _host_snapshot.engine_runtime(exe, shell_runner)
    assert engine["compat"] == {}
    assert engine["error"] == f"{tmp_path}/venv/bin/python could not read its packages (rc 3): ModuleNotFoundError: importlib"


def test_a_plan_record_that_cannot_be_read_is_no_plan_and_says_why(monkeypatch, capsys, tmp_path):
    (tmp_path / "main.plan.json").mkdir()  # not a file: reading it fails
    rc, out = run(monkeypatch, capsys, vllm_host_snapshot, {"instances": ["main"], "state_dir": str(tmp_path)})
    assert rc == 0
    assert out["instances"][0]["plan"] == {} and "main.plan.json" in out["instances"][0]["plan_error"]


def test_an_interpreter_that_is_a_broken_link_is_an_error_not_no_runtime(tmp_path):
    exe = fake_engine(tmp_path, None)
    (tmp_path / "venv" / "bin" / "python").symlink_to(tmp_path / "gone" / "python3")
    engine = _host_snapshot.engine_runtime(exe, shell_runner)
    assert engine["python"] == str(tmp_path / "venv" / "bin" / "python") and engine["compat"] == {}
    assert engine["error"].startswith(f"{tmp_path}/venv/bin/python could not read its packages")


def runtime_release(tmp_path, stamp: str | None):
    """A venv link to a release as the vllm_runtime role leaves them (the stamp written last)."""
    release = tmp_path / "releases" / "vllm-0.33.0-3f2a9c1d0e"
    (release / "bin").mkdir(parents=True)
    if stamp is not None:
        (release / ".gpufleet-complete").write_text(stamp)
    (tmp_path / "venv").symlink_to(release)
    return str(tmp_path / "venv"), str(release)


def test_the_install_record_is_the_release_the_venv_runs_and_its_stamp(monkeypatch, capsys, tmp_path):
    venv, release = runtime_release(tmp_path, '{"package": "vllm", "version": "0.33.0", "python": "/usr/bin/python3.12"}\n')
    rc, out = run(monkeypatch, capsys, vllm_host_snapshot, {"instances": ["main"], "state_dir": str(tmp_path), "runtime_venv": venv})
    assert rc == 0
    assert out["install_record"] == {"venv": venv, "release": release,
                                     "stamp": {"package": "vllm", "version": "0.33.0", "python": "/usr/bin/python3.12"}}
    assert out["install_record_error"] is None
    snap = out["ansible_facts"]["gpufleet_host_snapshot"]
    assert (snap["install_record"], snap["install_record_error"]) == (out["install_record"], None)


def test_a_venv_that_is_no_release_of_the_runtime_role_has_no_install_record(tmp_path):
    (tmp_path / "plain").mkdir()
    for venv in (str(tmp_path / "plain"), str(tmp_path / "missing"), ""):
        assert _host_snapshot.install_record(venv) == {"install_record": {}, "install_record_error": None}, venv


@pytest.mark.parametrize(("stamp", "error"), [
    (None, "/.gpufleet-complete: missing: {release} is not a complete release"),
    ("{not json", "/.gpufleet-complete: cannot be parsed: "),
    ("[1, 2]", "/.gpufleet-complete: expected a JSON object, got list"),
])
def test_a_release_whose_stamp_cannot_be_read_keeps_the_release_and_says_why(tmp_path, stamp, error):
    venv, release = runtime_release(tmp_path, stamp)
    got = _host_snapshot.install_record(venv)
    assert got["install_record"] == {"venv": venv, "release": release, "stamp": {}}
    assert got["install_record_error"].startswith(release + error.format(release=release)), got["install_record_error"]


def test_an_unreadable_stamp_is_named_not_fatal(tmp_path):
    venv, release = runtime_release(tmp_path, None)
    (tmp_path / "releases" / "vllm-0.33.0-3f2a9c1d0e" / ".gpufleet-complete").mkdir()  # not a file: reading it fails
    got = _host_snapshot.install_record(venv)
    assert got["install_record"]["stamp"] == {} and got["install_record_error"].startswith(f"{release}/.gpufleet-complete: cannot read")


class FakeRunuser:
    """``runuser -u USER -- find -L MODEL ! -readable -print`` as the model check runs it."""

    def __init__(self, unreadable: list[str]) -> None:
        self.unreadable, self.calls = unreadable, []

    def __call__(self, argv: Any, cwd: str | None = None) -> tuple[int, str, str]:
        self.calls.append((list(argv), cwd))
        assert list(argv[:5]) == ["runuser", "-u", "root", "--", "find"], argv
        return 0, "".join(f"{path}\n" for path in self.unreadable), ""


def test_the_model_check_is_the_account_modules_and_never_fails_the_snapshot(tmp_path):
    readable = FakeRunuser([])
    assert _host_snapshot.model_access(readable, "root", str(tmp_path)) == {
        "model": str(tmp_path), "user": "root", "checked": True, "error": None}
    # run from / (the user may not enter the controller's working directory)
    assert readable.calls == [(["runuser", "-u", "root", "--", "find", "-L", str(tmp_path), "!", "-readable", "-print"], "/")]
    access = _host_snapshot.model_access(FakeRunuser([f"{tmp_path}/model.safetensors"]), "root", str(tmp_path))
    assert access["checked"] is False
    assert access["error"].startswith(f"the service user root cannot read the model {tmp_path}: {tmp_path}/model.safetensors")
    # a user not created yet: nothing checked, no error (the deploy that creates it checks)
    nobody = FakeRunuser([])
    assert _host_snapshot.model_access(nobody, "gpufleet-no-such-user", str(tmp_path)) == {
        "model": str(tmp_path), "user": "gpufleet-no-such-user", "checked": False, "error": None}
    assert nobody.calls == []


def test_resolve_asks_the_system_resolver_and_names_what_does_not_resolve(monkeypatch, capsys, tmp_path):
    # the real resolver for an address literal and localhost (no network needed); a name the resolver
    # refuses stands in for one the site's DNS does not know (no test depends on a DNS server)
    real = _host_snapshot.socket.getaddrinfo

    def getaddrinfo(name, *args, **kwargs):
        if name.endswith(".invalid"):
            raise _host_snapshot.socket.gaierror(-2, "Name or service not known")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(_host_snapshot.socket, "getaddrinfo", getaddrinfo)
    rc, out = run(monkeypatch, capsys, vllm_host_snapshot,
                  {"instances": ["main"], "state_dir": str(tmp_path), "resolve": ["127.0.0.1", "localhost", "leader.invalid"]},
                  FakeSystemctl(UNITS))
    assert rc == 0, out
    by_name = {entry["name"]: entry for entry in out["resolved"]}
    assert [entry["name"] for entry in out["resolved"]] == ["127.0.0.1", "localhost", "leader.invalid"]
    assert by_name["127.0.0.1"] == {"name": "127.0.0.1", "addresses": ["127.0.0.1"], "error": None}
    assert by_name["localhost"]["addresses"] and by_name["localhost"]["error"] is None
    assert by_name["leader.invalid"] == {"name": "leader.invalid", "addresses": [], "error": "[Errno -2] Name or service not known"}


def test_nothing_to_resolve_is_an_empty_list(monkeypatch, capsys, tmp_path):
    rc, out = run(monkeypatch, capsys, vllm_host_snapshot, {"instances": ["main"], "state_dir": str(tmp_path)}, FakeSystemctl(UNITS))
    assert rc == 0 and out["resolved"] == []


def test_the_infiniband_devices_are_read_where_they_are(monkeypatch, capsys, tmp_path):
    """A host with /dev/infiniband lists its device nodes (a gang member's unit allows them); one without lists none."""
    devices = tmp_path / "infiniband"
    devices.mkdir()
    for name in ("uverbs1", "rdma_cm", "uverbs0"):
        (devices / name).touch()
    assert _host_snapshot.infiniband_devices(str(devices)) == ["rdma_cm", "uverbs0", "uverbs1"]
    assert _host_snapshot.infiniband_devices(str(tmp_path / "absent")) == []
    monkeypatch.setattr(_host_snapshot, "infiniband_devices", lambda: ["rdma_cm", "uverbs0"])
    rc, out = run(monkeypatch, capsys, vllm_host_snapshot, {"instances": ["main"], "state_dir": str(tmp_path)}, FakeSystemctl(UNITS))
    assert rc == 0 and out["infiniband"] == ["rdma_cm", "uverbs0"], out
