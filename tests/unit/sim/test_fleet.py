# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fleet description, what fleetctl writes from it, and the sim inventory agree."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
INVENTORY = ROOT / "inventories" / "sim"
GiB = 1 << 30


def _load_fleetctl():
    spec = importlib.util.spec_from_file_location("gpufleet_sim_fleetctl", ROOT / "sim" / "fleetctl.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


fleetctl = _load_fleetctl()


@pytest.fixture(scope="module")
def fleet() -> dict:
    return fleetctl.load_fleet(ROOT / "sim" / "fleet.yml")


@pytest.fixture(scope="module")
def inventory() -> tuple[dict, dict]:
    hosts = yaml.safe_load((INVENTORY / "hosts.yml").read_text())
    groups = hosts["all"]["children"]["gpufleet"]["children"]
    group_vars = {p.stem: yaml.safe_load(p.read_text()) for p in (INVENTORY / "group_vars").glob("*.yml")}
    return groups, group_vars


def test_fleet_shape_meets_the_demo_needs(fleet) -> None:
    assert len(fleet["classes"]) >= 2
    assert len(fleet["hosts"]) >= 6
    gpus = [fleet["classes"][h["class"]]["gpus"] for h in fleet["hosts"].values()]
    assert min(gpus) >= 2 and max(gpus) <= 8
    assert any(h.get("cotenants") for h in fleet["hosts"].values()), "no host with a weak rank"


def test_inventory_lists_the_fleet_hosts_by_class(fleet, inventory) -> None:
    groups, group_vars = inventory
    inv_hosts = {h: g for g, spec in groups.items() for h in spec["hosts"]}
    assert set(inv_hosts) == set(fleet["hosts"])
    for host, group in inv_hosts.items():
        assert group_vars[group]["gpufleet_host_class"] == fleet["hosts"][host]["class"]


def test_instances_fit_the_class_gpus(fleet, inventory) -> None:
    groups, group_vars = inventory
    multi = False
    for group in groups:
        gv = group_vars[group]
        cls = fleet["classes"][gv["gpufleet_host_class"]]
        used = [g for inst in gv["gpufleet_instances"] for g in inst["gpus"]]
        assert len(used) == len(set(used)) and set(used) <= set(range(cls["gpus"]))
        ports = [inst["port"] for inst in gv["gpufleet_instances"]]
        assert len(ports) == len(set(ports))
        tp = gv["gpufleet_serve_args"].get("tensor_parallel_size", 1) * gv["gpufleet_serve_args"].get(
            "pipeline_parallel_size", 1)
        assert all(len(inst["gpus"]) == tp for inst in gv["gpufleet_instances"])
        assert gv["gpufleet_model"] == f"/srv/models/{cls['model']}"
        assert gv["gpufleet_model_config"].endswith(f"sim/models/{cls['model']}/config.json")
        multi = multi or len(gv["gpufleet_instances"]) > 1
    assert multi, "no class with several instances per host"


def test_state_written_for_each_host_is_valid(fleet) -> None:
    nvml_state = fleetctl.nvml_state
    uuids = set()
    for host, spec in fleet["hosts"].items():
        state = fleetctl.build_state(fleet, host)
        text = nvml_state.dumps(state)
        back = nvml_state.loads(text)
        assert len(back["gpus"]) == fleet["classes"][spec["class"]]["gpus"]
        uuids |= {g["uuid"] for g in back["gpus"]}
        assert len(back["procs"]) == len(spec.get("cotenants") or [])
    assert len(uuids) == sum(fleet["classes"][s["class"]]["gpus"] for s in fleet["hosts"].values())
    weak = fleetctl.build_state(fleet, "sim-h200-3")
    assert weak["procs"] == [{"gpu": 2, "pid": 61002, "used": int(1.5 * GiB), "kind": "compute",
                              "name": "dcgm-exporter", "pidns": "other"}]


def test_sim_config_sizes_are_bytes(fleet) -> None:
    cfg = fleetctl.build_sim_config(fleet, "sim-h200-1")
    assert cfg["costs"]["cuda_context_bytes"] == 650969088
    assert cfg["costs"]["peak_activation_bytes"] == int(1.25 * GiB)
    assert cfg["boot_delay_s"] == 2 and cfg["fail_next_boot"] is None


@pytest.mark.parametrize(("text", "value"), [("1.5GiB", int(1.5 * GiB)), ("300MiB", 300 << 20), (4096, 4096),
                                             ("4GB", 4 * 10**9), ("0", 0)])
def test_parse_size(text, value) -> None:
    assert fleetctl.parse_size(text) == value


@pytest.mark.parametrize("bad", ["1.5 furlongs", "-1", True, "GiB"])
def test_parse_size_rejects(bad) -> None:
    with pytest.raises(fleetctl.FleetError):
        fleetctl.parse_size(bad)


def test_fleet_errors_name_the_field(tmp_path, fleet) -> None:
    broken = dict(fleet, hosts=dict(fleet["hosts"]))
    broken["hosts"]["sim-h200-1"] = dict(broken["hosts"]["sim-h200-1"], base_used=[0, 0])
    path = tmp_path / "fleet.yml"
    path.write_text(yaml.safe_dump(broken))
    with pytest.raises(fleetctl.FleetError, match=r"hosts\.sim-h200-1\.base_used: 2 entries for 4 GPUs"):
        fleetctl.load_fleet(path)


def _small_fleet(**host_fields) -> dict:
    return {
        "gpu_models": {"l40s": {"name": "NVIDIA L40S", "total": 48 * GiB, "reserved": "441MiB"},
                       "l40": {"name": "NVIDIA L40", "total": 48 * GiB, "reserved": "441MiB"}},
        "classes": {"c": {"gpu_model": "l40s", "gpus": 2, "model": "llama-3.1-8b-instruct"}},
        "hosts": {"sim-x-1": {"class": "c"}, "sim-x-2": dict({"class": "c"}, **host_fields)},
    }


def test_host_gpu_model_and_noise_reach_the_state(tmp_path) -> None:
    path = tmp_path / "fleet.yml"
    path.write_text(yaml.safe_dump(_small_fleet(gpu_model="l40", noise=[[], [0, "384MiB"]])))
    fleet = fleetctl.load_fleet(path)
    same, other = fleetctl.build_state(fleet, "sim-x-1"), fleetctl.build_state(fleet, "sim-x-2")
    assert [g["name"] for g in same["gpus"]] == ["NVIDIA L40S"] * 2
    assert [g["noise"] for g in same["gpus"]] == [[], []]
    assert [g["name"] for g in other["gpus"]] == ["NVIDIA L40"] * 2
    assert [g["noise"] for g in other["gpus"]] == [[], [0, 384 << 20]]
    back = fleetctl.nvml_state.loads(fleetctl.nvml_state.dumps(other))
    assert back["gpus"][1]["noise"] == [0, 384 << 20]


@pytest.mark.parametrize(("fields", "message"), [
    ({"gpu_model": "a100"}, r"hosts\.sim-x-2\.gpu_model: 'a100' is not in gpu_models"),
    ({"noise": [[0, 1]]}, r"hosts\.sim-x-2\.noise: expected a list of 2 lists"),
    ({"noise": [[], ["lots"]]}, r"hosts\.sim-x-2\.noise\[1\]\[0\]"),
])
def test_host_gpu_model_and_noise_errors_name_the_field(tmp_path, fields, message) -> None:
    path = tmp_path / "fleet.yml"
    path.write_text(yaml.safe_dump(_small_fleet(**fields)))
    with pytest.raises(fleetctl.FleetError, match=message):
        fleetctl.load_fleet(path)


def _fleet_with_state(tmp_path, monkeypatch) -> tuple[fleetctl.Fleet, Path]:
    """A small fleet whose host sim-x-2's NVML state file is a local file (the injections' target)."""
    path = tmp_path / "fleet.yml"
    path.write_text(yaml.safe_dump(_small_fleet()))
    sim = fleetctl.Fleet(path)
    state = tmp_path / "state"
    fleetctl.nvml_state.save(str(state), fleetctl.build_state(sim.fleet, "sim-x-2"))
    monkeypatch.setattr(sim, "state_file", lambda host: state)
    return sim, state


def test_inject_noise_sets_and_clears_one_gpu(tmp_path, monkeypatch) -> None:
    sim, state = _fleet_with_state(tmp_path, monkeypatch)
    sim.inject_noise("sim-x-2", 1, [0, 384 << 20])
    assert [g["noise"] for g in fleetctl.nvml_state.load(str(state))["gpus"]] == [[], [0, 384 << 20]]
    sim.inject_noise("sim-x-2", 1, None)
    assert [g["noise"] for g in fleetctl.nvml_state.load(str(state))["gpus"]] == [[], []]
    with pytest.raises(fleetctl.FleetError, match="sim-x-2: no GPU 2"):
        sim.inject_noise("sim-x-2", 2, [1])


def test_noise_command_line(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(fleetctl.os, "geteuid", lambda: 0)
    monkeypatch.setattr(fleetctl.Fleet, "inject_noise", lambda self, host, gpu, values: calls.append((host, gpu, values)))
    assert fleetctl.main(["inject", "sim-x-2", "noise", "--gpu", "1", "--bytes", "0, 384MiB"]) == 0
    assert fleetctl.main(["inject", "sim-x-2", "noise", "--gpu", "1", "--clear"]) == 0
    assert fleetctl.main(["inject", "sim-x-2", "noise", "--gpu", "1"]) == 1
    assert calls == [("sim-x-2", 1, [0, 384 << 20]), ("sim-x-2", 1, None)]


def test_inject_gpu_health_sets_and_clears_each_fault_on_one_gpu(tmp_path, monkeypatch) -> None:
    sim, state = _fleet_with_state(tmp_path, monkeypatch)

    def gpu(index: int) -> dict:
        return fleetctl.nvml_state.load(str(state))["gpus"][index]

    sim.inject_gpu_health("sim-x-2", 1, "remap-pending", clear=False)
    sim.inject_gpu_health("sim-x-2", 1, "xid", clear=False, xid=48)
    assert (gpu(1)["remap_pending"], gpu(1)["remap_uncorrected"], gpu(1)["xid"]) == (1, 1, [48])
    assert gpu(0)["remap_pending"] == 0 and gpu(0)["xid"] == []
    sim.inject_gpu_health("sim-x-2", 1, "remap-pending", clear=True)
    assert gpu(1)["remap_pending"] == 0 and gpu(1)["xid"] == [48], "--clear with --fault clears that fault alone"
    sim.inject_gpu_health("sim-x-2", 1, "ecc-uncorrected", clear=False)
    sim.inject_gpu_health("sim-x-2", 1, None, clear=True)
    assert {k: gpu(1)[k] for k in fleetctl.nvml_state.HEALTH_DEFAULTS} == fleetctl.nvml_state.HEALTH_DEFAULTS
    with pytest.raises(fleetctl.FleetError, match="sim-x-2: no GPU 2"):
        sim.inject_gpu_health("sim-x-2", 2, "remap-failure", clear=False)
    with pytest.raises(fleetctl.FleetError, match="--fault is required"):
        sim.inject_gpu_health("sim-x-2", 1, None, clear=False)


def test_gpu_health_command_line(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(fleetctl.os, "geteuid", lambda: 0)
    monkeypatch.setattr(fleetctl.Fleet, "inject_gpu_health",
                        lambda self, host, gpu, fault, clear, xid: calls.append((host, gpu, fault, clear, xid)))
    assert fleetctl.main(["inject", "sim-x-2", "gpu-health", "--gpu", "1", "--fault", "remap-pending"]) == 0
    assert fleetctl.main(["inject", "sim-x-2", "gpu-health", "--gpu", "0", "--fault", "xid", "--xid", "95"]) == 0
    assert fleetctl.main(["inject", "sim-x-2", "gpu-health", "--gpu", "1", "--clear"]) == 0
    with pytest.raises(SystemExit):
        fleetctl.main(["inject", "sim-x-2", "gpu-health", "--gpu", "1", "--fault", "melted"])
    assert calls == [("sim-x-2", 1, "remap-pending", False, None), ("sim-x-2", 0, "xid", False, 95), ("sim-x-2", 1, None, True, None)]


def test_report_summary_reads_class_sections() -> None:
    plan = {"decision": "deploy", "kv_cache_memory_bytes": 30 * GiB, "kv_cache_tokens": 196608,
            "free_floor_bytes": {"0": 40 * GiB}}
    report = {"classes": {"h200-tp2": {"plan": plan, "hosts_rolled_out": ["a", "b"]}}}
    (line,) = fleetctl.summarize_report(report)
    assert "decision=deploy" in line and "tokens=196608" in line and "30.00 GiB" in line
    assert "floor=40.00 GiB" in line and "hosts=2" in line


def test_report_summary_reads_the_rollout_report_schema() -> None:
    report = {
        "classes": [
            {"name": "h200-tp2", "decision": "deploy", "status": "deployable",
             "free_floor_bytes": {"0": 41 * GiB, "1": 40 * GiB}, "hosts": ["a", "b"],
             "plan": {"kv_cache_memory_bytes": 28 * GiB, "kv_cache_tokens": 180000}},
            {"name": "l40s-tp2", "decision": None, "status": "failed", "free_floor_bytes": {},
             "reasons": ["class l40s-tp2 stopped: canary failed"], "hosts": ["c"], "plan": {}},
        ],
        "hosts": [{"host": "a", "class": "h200-tp2", "outcome": "deployed"},
                  {"host": "b", "class": "h200-tp2", "outcome": "rolled_back"},
                  {"host": "c", "class": "l40s-tp2", "outcome": "failed"}],
    }
    lines = fleetctl.summarize_report(report)
    assert lines[0].split() == ["h200-tp2", "decision=deploy", f"bytes={28 * GiB}", "(28.00", "GiB)",
                                "tokens=180000", "floor=40.00", "GiB", "hosts", "deployed=1,rolled_back=1",
                                "status=deployable"]
    assert "decision=None" in lines[1] and "bytes=-" in lines[1] and "hosts failed=1" in lines[1]
    assert lines[2].strip() == "class l40s-tp2 stopped: canary failed"


def test_batch_summary_shows_each_class_ramp() -> None:
    report = {"batches": [
        {"index": 1, "class": "h200-tp2", "class_index": 1, "class_total": 2, "hosts": [{"host": "a"}], "outcome": "ok"},
        {"index": 2, "class": "h200-tp2", "class_index": 2, "class_total": 2, "hosts": [{"host": "b"}, {"host": "c"}],
         "outcome": "ok"},
        {"index": 3, "class": "l40s-tp2", "class_index": 1, "class_total": 3, "hosts": [{"host": "d"}], "outcome": "failed"},
    ]}
    assert [line.split(None, 1) for line in fleetctl.summarize_batches(report)] == [
        ["h200-tp2", "1/2: a (ok) -> 2/2: b, c (ok)"], ["l40s-tp2", "1/3: d (failed)"]]
    assert not fleetctl.summarize_batches({"batches": [{"index": 1, "hosts": ["a"]}]}), "a report without classes shows no ramp"


def test_connection_script_adds_only_the_inventory_hosts(fleet) -> None:
    spec = importlib.util.spec_from_file_location("gpufleet_sim_connection", INVENTORY / "connection.py")
    assert spec is not None and spec.loader is not None
    connection = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(connection)
    assert connection.inventory_hosts() == set(fleet["hosts"])
    assert connection._names({"all": {"children": {"g": {"hosts": {"a": None}, "children": {  # pylint: disable=protected-access
        "h": {"hosts": {"b": {}}}}}}}}) == {"a", "b"}


def test_fault_kinds_agree_with_the_engine(engine) -> None:
    assert set(fleetctl.FAULT_KINDS) == set(engine.FAULT_KINDS)
