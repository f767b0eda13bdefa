#!/usr/bin/env python
"""Create, fault and demo the simulated GPU fleet (run on the controller, as root).

    fleetctl.py create  [--fleet sim/fleet.yml] [--reset-state]
    fleetctl.py destroy [--fleet FILE] [--all]
    fleetctl.py inject HOST cotenant --gpu N --bytes SIZE [--pid PID] [--remove]
    fleetctl.py inject HOST gpu-lost --gpu N [--clear]
    fleetctl.py inject HOST gpu-replaced --gpu N [--clear]
    fleetctl.py inject HOST gpu-health --gpu N --fault remap-pending|remap-failure|ecc-uncorrected|retired-pages-pending|xid
                                       [--xid N] [--clear]
    fleetctl.py inject HOST noise --gpu N --bytes A,B,... [--clear]
    fleetctl.py inject HOST fail-next-boot [--kind oom|startup|one_request|no_memory|profiling_error|gpu_lost|hang|crash]
    fleetctl.py inject HOST slow-next-boot [--seconds S] [--steps N] [--clear]
    fleetctl.py inject HOST latency-next-boot [--token-delay S] [--clear]
                                           [--clear]
    fleetctl.py inject HOST unreachable [--clear]
    fleetctl.py status
    fleetctl.py demo    [--fleet sim/fleet.yml] [--playbook playbooks/rollout.yml]

Hosts are test hosts of ``tests/hosts/testhosts.py``. Per host this writes the fake
NVML state (``/etc/fake-nvml/state``) and the simulated engine's settings
(``/etc/fake-nvml/sim.json``), installs the simulated engine as
``/opt/vllm/venv/bin/vllm``, a ``vllm`` system user and the model configs under
``/srv/models/``.  An existing state or settings file is kept unless
``--reset-state`` is given (running engines have their processes in it).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "hosts"))
sys.path.insert(0, str(REPO / "tests" / "fake_nvml"))

import nvml_state  # noqa: E402  pylint: disable=wrong-import-position,import-error
import testhosts  # noqa: E402  pylint: disable=wrong-import-position,import-error

DEFAULT_FLEET = REPO / "sim" / "fleet.yml"
ENGINE_SRC = REPO / "sim" / "engine" / "vllm"
MODELS_SRC = REPO / "sim" / "models"
ENGINE_GUEST = "/opt/vllm/venv/bin/vllm"
MODELS_GUEST = "/srv/models"
HOST_PREFIX = "sim-"
COTENANT_PID_BASE = 61000
# NVML health faults of ``inject gpu-health``: the fake NVML state keys each sets (``xid``: the event list)
HEALTH_FAULTS = {
    "remap-pending": {"remap_pending": 1, "remap_uncorrected": 1},
    "remap-failure": {"remap_failure": 1, "remap_uncorrected": 1},
    "ecc-uncorrected": {"ecc_uncorrected_volatile": 1, "ecc_uncorrected_aggregate": 1},
    "retired-pages-pending": {"retired_pending": 1},
    "xid": {"xid": [79]},
}
FAULT_KINDS = ("oom", "startup", "one_request", "no_memory", "profiling_error", "gpu_lost", "hang", "crash")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class FleetError(Exception):
    """A problem with the fleet description, a host or a command (message says which)."""


# ---------------------------------------------------------------------------- helpers
def parse_size(value: Any, what: str = "size") -> int:
    """``1.5GiB`` / ``300MiB`` / ``4GB`` / ``1073741824`` -> bytes."""
    if isinstance(value, bool):
        raise FleetError(f"{what}: {value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise FleetError(f"{what}: {value} is negative")
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise FleetError(f"{what}: {value!r} is not a size (use bytes or e.g. 1.5GiB, 300MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def human(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def cache_dir() -> Path:
    env = os.environ.get("GPUFLEET_CACHE")
    return Path(env).resolve() if env else REPO / ".cache"


def record_path() -> Path:
    return cache_dir() / "sim" / "fleet.json"


atomic_write = testhosts.atomic_write  # temp file in the same directory, fsync, rename


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """flock on ``<path>.lock``: the convention the simulated engine uses for sim.json."""
    fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o664)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


# ---------------------------------------------------------------------------- fleet description
def load_fleet(path: Path) -> dict[str, Any]:
    """Read and check a fleet file; every error names the field."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FleetError(f"fleet file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise FleetError(f"fleet file {path}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise FleetError(f"fleet file {path}: expected a mapping")
    for key in ("gpu_models", "classes", "hosts"):
        if not isinstance(data.get(key), dict) or not data[key]:
            raise FleetError(f"fleet file {path}: `{key}` must be a non-empty mapping")
    for cname, cls in data["classes"].items():
        where = f"classes.{cname}"
        if cls.get("gpu_model") not in data["gpu_models"]:
            raise FleetError(f"{where}.gpu_model: {cls.get('gpu_model')!r} is not in gpu_models")
        if not isinstance(cls.get("gpus"), int) or not 1 <= cls["gpus"] <= 16:
            raise FleetError(f"{where}.gpus: expected an integer 1-16")
        if not (MODELS_SRC / str(cls.get("model")) / "config.json").is_file():
            raise FleetError(f"{where}.model: no sim/models/{cls.get('model')}/config.json")
    for gname, gpu in data["gpu_models"].items():
        for key in ("name", "total"):
            if key not in gpu:
                raise FleetError(f"gpu_models.{gname}.{key}: missing")
    for hname, host in data["hosts"].items():
        where = f"hosts.{hname}"
        if not testhosts.NAME_RE.match(hname) or not hname.startswith(HOST_PREFIX):
            raise FleetError(f"{where}: host names must start with {HOST_PREFIX!r} and use a-z, 0-9, '-'")
        if host.get("class") not in data["classes"]:
            raise FleetError(f"{where}.class: {host.get('class')!r} is not in classes")
        if host.get("gpu_model") is not None and host["gpu_model"] not in data["gpu_models"]:
            raise FleetError(f"{where}.gpu_model: {host['gpu_model']!r} is not in gpu_models")
        ngpu = data["classes"][host["class"]]["gpus"]
        base = host.get("base_used", [0] * ngpu)
        if len(base) != ngpu:
            raise FleetError(f"{where}.base_used: {len(base)} entries for {ngpu} GPUs")
        for i, val in enumerate(base):
            parse_size(val, f"{where}.base_used[{i}]")
        for i, co in enumerate(host.get("cotenants") or []):
            if not isinstance(co.get("gpu"), int) or not 0 <= co["gpu"] < ngpu:
                raise FleetError(f"{where}.cotenants[{i}].gpu: expected 0-{ngpu - 1}")
            parse_size(co.get("bytes"), f"{where}.cotenants[{i}].bytes")
        noise = host.get("noise")
        if noise is not None:
            if not isinstance(noise, list) or len(noise) != ngpu:
                raise FleetError(f"{where}.noise: expected a list of {ngpu} lists (one per GPU)")
            for i, values in enumerate(noise):
                if not isinstance(values, list):
                    raise FleetError(f"{where}.noise[{i}]: expected a list of sizes")
                for j, val in enumerate(values):
                    parse_size(val, f"{where}.noise[{i}][{j}]")
    return data


def host_gpu_model(fleet: dict[str, Any], host: str) -> str:
    """The GPU model of a host: its own ``gpu_model``, else its class's."""
    spec = fleet["hosts"][host]
    return str(spec.get("gpu_model") or fleet["classes"][spec["class"]]["gpu_model"])


def gpu_uuid(host: str, index: int, card: str = "") -> str:
    """The NVML UUID of a host's GPU; ``card`` names another card at the same index (a replacement)."""
    digest = hashlib.sha256(f"{host}/{index}{card}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def build_state(fleet: dict[str, Any], host: str) -> dict[str, Any]:
    """The fake NVML state of one host, in nvml_state's dict shape."""
    spec = fleet["hosts"][host]
    cls = fleet["classes"][spec["class"]]
    model = fleet["gpu_models"][host_gpu_model(fleet, host)]
    state = nvml_state.new_state()
    state["system"].update({k: v for k, v in (fleet.get("system") or {}).items() if k in state["system"]})
    base = spec.get("base_used", [0] * cls["gpus"])
    noise = spec.get("noise") or [[] for _gpu in range(cls["gpus"])]
    for i in range(cls["gpus"]):
        state["gpus"].append(nvml_state.make_gpu(
            i, parse_size(model["total"]), name=model["name"], uuid=gpu_uuid(host, i),
            reserved=parse_size(model.get("reserved", 0)), cc=str(model.get("cc", "9.0")),
            base_used=parse_size(base[i]), noise=[parse_size(v) for v in noise[i]]))
    # A co-tenant is a process no guest runs (a made-up pid): recorded as one of another pid
    # namespace, like a container's process, so the fake NVML keeps listing it (it drops the
    # records of this namespace's pids that no longer exist, as a driver frees a dead process's memory).
    for n, co in enumerate(spec.get("cotenants") or []):
        nvml_state.add_process(state, gpu=co["gpu"], pid=int(co.get("pid") or COTENANT_PID_BASE + n),
                               used=parse_size(co["bytes"]), name=str(co.get("name", "python3")), pidns="other")
    nvml_state.validate(state)
    return state


def build_sim_config(fleet: dict[str, Any], host: str) -> dict[str, Any]:
    engine = dict(fleet.get("engine") or {})
    costs = {k: (v if isinstance(v, bool) or v is None else parse_size(v, f"engine.costs.{k}"))
             for k, v in (engine.pop("costs", None) or {}).items()}
    per_host = fleet["hosts"][host].get("engine") or {}
    costs.update({k: parse_size(v, f"hosts.{host}.engine.costs.{k}") for k, v in (per_host.get("costs") or {}).items()})
    cfg = {"boot_delay_s": 2.0, "token_delay_s": 0.004, "fail_next_boot": None}
    cfg.update(engine)
    cfg.update({k: v for k, v in per_host.items() if k != "costs"})
    cfg["costs"] = costs
    return cfg


# ---------------------------------------------------------------------------- fleet operations
class Fleet:
    def __init__(self, fleet_path: Path = DEFAULT_FLEET):
        self.fleet_path = fleet_path
        self.h = testhosts.Harness()

    @property
    def fleet(self) -> dict[str, Any]:
        return load_fleet(self.fleet_path)

    def _record(self) -> dict[str, Any]:
        path = record_path()
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
        return {"hosts": []}

    def info(self, host: str) -> testhosts.HostInfo:
        try:
            return self.h.get(host)
        except testhosts.HarnessError as exc:
            raise FleetError(str(exc)) from None

    def state_file(self, host: str) -> Path:
        return Path(self.info(host).fake_nvml_dir) / "state"

    def sim_file(self, host: str) -> Path:
        return Path(self.info(host).fake_nvml_dir) / "sim.json"

    # -------------------------------------------------------------- create
    def create(self, reset_state: bool = False, timeout: float = 180.0) -> list[str]:
        fleet = self.fleet
        names = list(fleet["hosts"])
        t0 = time.monotonic()
        already_up = set(self.h.hosts())
        try:
            self.h.up(names, timeout=timeout)
        except testhosts.HarnessError as exc:
            raise FleetError(f"booting the fleet failed: {exc}") from None
        for host in names:
            # a host that was down has no engine running: files left by an earlier life are stale
            self._provision(fleet, host, reset_state or host not in already_up)
        record_path().parent.mkdir(parents=True, exist_ok=True)
        with file_lock(record_path()):
            record = self._record()
            record["hosts"] = sorted(set(record.get("hosts") or []) | set(names))
            record.setdefault("fleet_files", {})[str(self.fleet_path)] = {"hosts": names, "created_at": time.time()}
            atomic_write(record_path(), json.dumps(record, indent=2, sort_keys=True) + "\n")
        print(f"fleet up: {len(names)} hosts in {time.monotonic() - t0:.1f}s")
        return names

    def _guest_ids(self, host: str) -> tuple[int, int]:
        probe = self.h.exec(host, ["id", "-u", "vllm"])
        if probe.returncode != 0:
            self.h.exec(host, ["useradd", "--system", "--home-dir", "/var/lib/vllm", "--shell", "/usr/sbin/nologin",
                               "--user-group", "vllm"], check=True)
        uid = int(self.h.exec(host, ["id", "-u", "vllm"], check=True).stdout.strip())
        gid = int(self.h.exec(host, ["id", "-g", "vllm"], check=True).stdout.strip())
        return uid, gid

    def _provision(self, fleet: dict[str, Any], host: str, reset_state: bool) -> None:
        info = self.info(host)
        root = Path(info.root)
        cls = fleet["classes"][fleet["hosts"][host]["class"]]
        # the simulated engine, as a venv entry point with the guest's interpreter
        engine = ENGINE_SRC.read_text(encoding="utf-8").split("\n", 1)[1]
        dest = root / ENGINE_GUEST.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(dest, "#!/usr/bin/python3\n" + engine, mode=0o755)
        # the venv's interpreter, which runs the boot gate of the units (pynvml is in the guest's python3)
        python = dest.parent / "python3"
        if not python.is_symlink():
            python.symlink_to("/usr/bin/python3")
        # prometheus_client, which every vLLM venv carries, for the units' metrics exporter
        client = root / "usr/local/lib/python3.11/dist-packages/prometheus_client"
        if not client.exists():
            import prometheus_client  # pylint: disable=import-outside-toplevel
            shutil.copytree(Path(prometheus_client.__file__).parent, client,
                            ignore=shutil.ignore_patterns("__pycache__"))
        for model_dir in sorted(p for p in MODELS_SRC.iterdir() if (p / "config.json").is_file()):
            target = root / MODELS_GUEST.lstrip("/") / model_dir.name
            target.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(model_dir / "config.json", target / "config.json")
        uid, gid = self._guest_ids(host)
        fake = Path(info.fake_nvml_dir)
        state_path, sim_path = fake / "state", fake / "sim.json"
        with nvml_state.locked(str(state_path)):
            if reset_state or not state_path.exists():
                nvml_state.save(str(state_path), build_state(fleet, host))
            else:
                print(f"{host}: keeping existing NVML state (use --reset-state to rewrite it)")
        with file_lock(sim_path):
            if reset_state or not sim_path.exists():
                atomic_write(sim_path, json.dumps(build_sim_config(fleet, host), indent=2, sort_keys=True) + "\n")
        # the engine runs as `vllm` and rewrites both files (temp file + rename) under their locks
        os.chown(fake, uid, gid)
        os.chmod(fake, 0o775)
        for path in (state_path, sim_path, Path(str(state_path) + ".lock"), Path(str(sim_path) + ".lock")):
            if not path.exists():
                path.touch(mode=0o664)
            os.chown(path, uid, gid)
            os.chmod(path, 0o664)
        print(f"{host}: {info.address} class {fleet['hosts'][host]['class']} {cls['gpus']}x "
              f"{fleet['gpu_models'][host_gpu_model(fleet, host)]['name']} model {cls['model']}")

    # -------------------------------------------------------------- destroy
    def destroy(self, all_hosts: bool = False) -> list[str]:
        """Stop this fleet file's hosts; with ``all_hosts`` every simulated host ever created."""
        record = self._record()
        names: set[str] = set()
        with contextlib.suppress(FleetError):
            names |= set(self.fleet["hosts"])
        if all_hosts:
            names |= set(record.get("hosts") or [])
        names = {n for n in names if n.startswith(HOST_PREFIX)}
        if not names:
            print("no simulated host to destroy")
            return []
        try:
            done = self.h.down(sorted(names))
        except testhosts.HarnessError as exc:
            raise FleetError(f"destroy: {exc}") from None
        record_path().parent.mkdir(parents=True, exist_ok=True)
        with file_lock(record_path()):
            record = self._record()
            left = sorted(set(record.get("hosts") or []) - set(done))
            record["hosts"] = left
            record["fleet_files"] = {k: v for k, v in (record.get("fleet_files") or {}).items()
                                     if set(v.get("hosts") or []) & set(left)}
            atomic_write(record_path(), json.dumps(record, indent=2, sort_keys=True) + "\n")
        print(f"destroyed: {', '.join(done)}")
        return done

    # -------------------------------------------------------------- inject
    def _edit_state(self, host: str, mutate) -> None:
        path = str(self.state_file(host))
        with nvml_state.locked(path):
            state = nvml_state.load(path)
            mutate(state)
            nvml_state.save(path, state)

    def inject_cotenant(self, host: str, gpu: int, size: int | None, pid: int | None, remove: bool) -> None:
        def mutate(state: dict[str, Any]) -> None:
            if not 0 <= gpu < len(state["gpus"]):
                raise FleetError(f"{host}: no GPU {gpu} (it has {len(state['gpus'])})")
            if remove:
                gone = [p["pid"] for p in state["procs"] if p["gpu"] == gpu
                        and (p["pid"] == pid if pid else COTENANT_PID_BASE <= p["pid"] < COTENANT_PID_BASE + 1000)]
                if not gone:
                    raise FleetError(f"{host}: no injected co-tenant on GPU {gpu}")
                state["procs"] = [p for p in state["procs"] if not (p["gpu"] == gpu and p["pid"] in gone)]
                print(f"{host}: removed co-tenant(s) {gone} from GPU {gpu}")
                return
            if size is None:
                raise FleetError("cotenant: --bytes is required (unless --remove)")
            taken = {p["pid"] for p in state["procs"]}
            new_pid = pid or next(p for p in range(COTENANT_PID_BASE + 100, COTENANT_PID_BASE + 1000) if p not in taken)
            nvml_state.add_process(state, gpu=gpu, pid=new_pid, used=size, name="python3", pidns="other")
            print(f"{host}: co-tenant pid {new_pid} holds {human(size)} on GPU {gpu}")
        self._edit_state(host, mutate)

    def inject_gpu_lost(self, host: str, gpu: int, clear: bool) -> None:
        def mutate(state: dict[str, Any]) -> None:
            for g in state["gpus"]:
                if g["index"] == gpu:
                    g["error"] = 0 if clear else 15   # NVML_ERROR_GPU_IS_LOST
                    return
            raise FleetError(f"{host}: no GPU {gpu} (it has {len(state['gpus'])})")
        self._edit_state(host, mutate)
        print(f"{host}: GPU {gpu} {'back' if clear else 'lost (NVML error 15)'}")

    def inject_gpu_replaced(self, host: str, gpu: int, clear: bool) -> None:
        """Another card at index ``gpu`` (its UUID changes), as after a replacement or a re-enumeration; --clear: the original."""
        uuid = gpu_uuid(host, gpu) if clear else gpu_uuid(host, gpu, "/replacement")

        def mutate(state: dict[str, Any]) -> None:
            for g in state["gpus"]:
                if g["index"] == gpu:
                    g["uuid"] = uuid
                    return
            raise FleetError(f"{host}: no GPU {gpu} (it has {len(state['gpus'])})")
        self._edit_state(host, mutate)
        print(f"{host}: GPU {gpu} is {'the original card' if clear else 'another card'} ({uuid})")

    def inject_gpu_health(self, host: str, gpu: int, fault: str | None, clear: bool, xid: int | None = None) -> None:
        """An NVML health fault on GPU ``gpu`` (:data:`HEALTH_FAULTS`); ``clear``: that fault (None: every one) gone.

        ``xid``: the Xid number of an ``xid`` fault (79 by default: the GPU fell off the bus); every process that
        listens for Xid events on the GPU (the boot gate with ``vllm_service_boot_gate_xid_wait_ms``) receives it.
        """
        if fault is None and not clear:
            raise FleetError(f"gpu-health: --fault is required (one of {', '.join(HEALTH_FAULTS)}) unless --clear")
        if fault is not None and fault not in HEALTH_FAULTS:
            raise FleetError(f"gpu-health: --fault {fault!r} is not one of {', '.join(HEALTH_FAULTS)}")
        faults = [fault] if fault else list(HEALTH_FAULTS)

        def mutate(state: dict[str, Any]) -> None:
            for g in state["gpus"]:
                if g["index"] == gpu:
                    for name in faults:
                        for key, value in HEALTH_FAULTS[name].items():
                            if clear:
                                g[key] = nvml_state.HEALTH_DEFAULTS[key]
                            elif key == "xid":
                                g[key] = [*g.get(key, []), xid or value[0]]
                            else:
                                g[key] = value
                    return
            raise FleetError(f"{host}: no GPU {gpu} (it has {len(state['gpus'])})")
        self._edit_state(host, mutate)
        print(f"{host}: GPU {gpu} {'healthy again' if clear else 'has the health fault'} ({', '.join(faults)})")

    def inject_noise(self, host: str, gpu: int, values: list[int] | None) -> None:
        """Make free memory of one GPU move between reads (None or []: steady again).

        NVML readers on the host (the probe, the gate) see ``free`` lowered by the
        values in turn, one per memory read of their process (the fake library's
        ``noise``); the simulated engine reads the state file itself and is not
        affected.
        """
        def mutate(state: dict[str, Any]) -> None:
            for g in state["gpus"]:
                if g["index"] == gpu:
                    g["noise"] = list(values or [])
                    return
            raise FleetError(f"{host}: no GPU {gpu} (it has {len(state['gpus'])})")
        self._edit_state(host, mutate)
        if values:
            print(f"{host}: GPU {gpu} free memory moves by {', '.join(human(v) for v in values)} between reads")
        else:
            print(f"{host}: GPU {gpu} free memory steady")

    def inject_fail_next_boot(self, host: str, kind: str | None) -> None:
        """Make the next engine boot on ``host`` fail with ``kind`` (None: cancel a pending fault)."""
        path = self.sim_file(host)
        with file_lock(path):
            data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
            data["fail_next_boot"] = {"kind": kind} if kind else None
            st = path.stat() if path.exists() else None
            atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n", mode=0o664)
            if st is not None:
                os.chown(path, st.st_uid, st.st_gid)
        print(f"{host}: the next engine boot fails ({kind})" if kind else f"{host}: no pending boot failure")

    def inject_slow_next_boot(self, host: str, boot_delay_s: float | None, load_steps: int = 20) -> None:
        """Make the next engine boot on ``host`` take ``boot_delay_s`` seconds, its GPU memory growing in
        ``load_steps`` increments while the weights load (None: cancel a pending slow boot)."""
        path = self.sim_file(host)
        with file_lock(path):
            data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
            data["slow_next_boot"] = {"boot_delay_s": float(boot_delay_s), "load_steps": int(load_steps)} if boot_delay_s else None
            st = path.stat() if path.exists() else None
            atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n", mode=0o664)
            if st is not None:
                os.chown(path, st.st_uid, st.st_gid)
        print(f"{host}: the next engine boot takes {boot_delay_s} s, loading in {load_steps} steps" if boot_delay_s
              else f"{host}: no pending slow boot")

    def inject_latency_next_boot(self, host: str, token_delay_s: float | None) -> None:
        """Make the next engine boot on ``host`` serve ``token_delay_s`` seconds per output token for its
        whole life, as a slower new engine or unit would (None: cancel a pending one)."""
        path = self.sim_file(host)
        with file_lock(path):
            data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
            data["latency_next_boot"] = {"token_delay_s": float(token_delay_s)} if token_delay_s is not None else None
            st = path.stat() if path.exists() else None
            atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n", mode=0o664)
            if st is not None:
                os.chown(path, st.st_uid, st.st_gid)
        print(f"{host}: the next engine serves {token_delay_s} s per output token" if token_delay_s is not None
              else f"{host}: no pending latency")

    def inject_unreachable(self, host: str, clear: bool) -> None:
        info = self.info(host)
        proc = subprocess.run(["ip", "link", "set", info.veth, "up" if clear else "down"],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise FleetError(f"{host}: ip link set {info.veth}: {proc.stderr.strip()}")
        print(f"{host}: {'reachable again' if clear else 'unreachable (link ' + info.veth + ' down)'}")

    # -------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        up = self.h.hosts()
        out: dict[str, Any] = {}
        names = sorted(set(self._record().get("hosts") or []) | {n for n in up if n.startswith(HOST_PREFIX)})
        for host in names:
            info = up.get(host)
            entry: dict[str, Any] = {"up": info is not None}
            if info is not None:
                entry["address"] = info.address
                link = Path(f"/sys/class/net/{info.veth}/operstate")
                entry["reachable"] = link.exists() and link.read_text().strip() != "down"
                fake = Path(info.fake_nvml_dir)
                with contextlib.suppress(OSError, nvml_state.StateError):
                    state = nvml_state.load(str(fake / "state"))
                    used: dict[int, int] = {}
                    for p in state["procs"]:
                        used[p["gpu"]] = used.get(p["gpu"], 0) + p["used"]
                    entry["gpus"] = [{"index": g["index"], "name": g["name"], "error": g["error"], "noise": g["noise"],
                                      "free": g["total"] - g["reserved"] - g["base_used"] - used.get(g["index"], 0)}
                                     for g in state["gpus"]]
                    entry["processes"] = state["procs"]
                with contextlib.suppress(OSError, ValueError):
                    entry["fail_next_boot"] = json.loads((fake / "sim.json").read_text())["fail_next_boot"]
            out[host] = entry
        return out


# ---------------------------------------------------------------------------- demo
def find_playbook(explicit: str | None) -> Path:
    if explicit:
        path = (REPO / explicit).resolve() if not os.path.isabs(explicit) else Path(explicit)
        if not path.is_file():
            raise FleetError(f"playbook {explicit} does not exist")
        return path
    for name in ("rollout.yml", "plan.yml", "probe.yml"):
        path = REPO / "playbooks" / name
        if path.is_file():
            return path
    raise FleetError("no playbook to run: playbooks/rollout.yml (or plan.yml, probe.yml) does not exist yet")


def newest_report(report_dir: Path, since: float) -> Path | None:
    """The newest JSON report written since ``since`` (``<run>/report.json`` or ``<run>.json``)."""
    files = [Path(p) for p in glob.glob(str(report_dir / "**" / "*.json"), recursive=True)]
    files = [p for p in files if p.stat().st_mtime >= since - 1]
    return max(files, key=lambda p: p.stat().st_mtime) if files else None


def _first(d: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in d and d[key] is not None:
            return d[key]
    return None


def summarize_report(report: Any) -> list[str]:
    """One line per host class from a run report: decision, budget, tokens, floor, hosts deployed.

    Reads the classes as a list (``name``) or a mapping, figures at class level or under
    ``plan``, and per-host outcomes from the top-level ``hosts`` list when present.
    """
    if not isinstance(report, dict):
        return []
    src = report.get("classes")
    classes: list[tuple[str, dict[str, Any]]] = []
    if isinstance(src, dict):
        classes = [(str(k), v) for k, v in src.items() if isinstance(v, dict)]
    elif isinstance(src, list):
        classes = [(str(v.get("name") or v.get("host_class") or i), v) for i, v in enumerate(src) if isinstance(v, dict)]
    outcomes: dict[str, list[str]] = {}
    for entry in report.get("hosts") or []:
        if isinstance(entry, dict) and entry.get("class"):
            outcomes.setdefault(str(entry["class"]), []).append(str(entry.get("outcome")))
    lines = []
    for name, c in classes:
        plan = c.get("plan") if isinstance(c.get("plan"), dict) else {}
        both = (c, plan)

        def pick(*keys: str, sources: tuple[dict[str, Any], ...] = both) -> Any:
            for src_d in sources:
                value = _first(src_d, *keys)
                if value not in (None, {}, []):
                    return value
            return None

        floor = pick("free_floor_bytes")
        if isinstance(floor, dict):
            floor = min(int(v) for v in floor.values())
        budget = pick("kv_cache_memory_bytes")
        if name in outcomes:
            counts = {o: outcomes[name].count(o) for o in sorted(set(outcomes[name]))}
            hosts = "hosts " + ",".join(f"{o}={n}" for o, n in counts.items())
        else:
            rolled = pick("hosts_rolled_out", "rolled_out", "deployed_hosts", "hosts")
            hosts = f"hosts={len(rolled) if isinstance(rolled, list) else rolled}"
        status = pick("status")
        if status is None and c.get("failed") is not None:
            status = "failed" if c.get("failed") else "ok"
        lines.append(
            f"  {name:<12} decision={pick('decision')} "
            f"bytes={budget if budget is not None else '-'}"
            f"{' (' + human(int(budget)) + ')' if isinstance(budget, int) else ''} "
            f"tokens={pick('kv_cache_tokens')} "
            f"floor={human(int(floor)) if isinstance(floor, int) else '-'} "
            f"{hosts} status={status}")
        if status == "failed":
            for reason in (c.get("reasons") or [])[:2]:
                lines.append(f"      {str(reason)[:300]}")
    return lines


def summarize_batches(report: Any) -> list[str]:
    """One line per class from a run report's batches: its ramp, batch by batch (``1+1+2 hosts``)."""
    if not isinstance(report, dict):
        return []
    ramps: dict[str, list[str]] = {}
    for batch in report.get("batches") or []:
        if not isinstance(batch, dict) or not batch.get("class"):
            continue
        hosts = [h["host"] if isinstance(h, dict) else str(h) for h in batch.get("hosts") or []]
        ramps.setdefault(str(batch["class"]), []).append(
            f"{batch.get('class_index')}/{batch.get('class_total')}: {', '.join(hosts)} ({batch.get('outcome', '?')})")
    return [f"  {name:<12} " + " -> ".join(steps) for name, steps in ramps.items()]


def demo(fleet: Fleet, playbook: str | None) -> int:
    playbook_path = find_playbook(playbook)
    fleet.create()
    env = dict(os.environ)
    env.setdefault("ANSIBLE_COLLECTIONS_PATH", str(cache_dir() / "collections"))
    env.setdefault("ANSIBLE_HOST_KEY_CHECKING", "False")
    report_dir = REPO / "reports" / "sim"
    argv = [shutil.which("ansible-playbook") or "ansible-playbook", "-i", str(REPO / "inventories" / "sim"),
            str(playbook_path)]
    print("running:", " ".join(argv))
    t0, wall0 = time.monotonic(), time.time()
    rc = subprocess.call(argv, cwd=str(REPO), env=env)
    took = time.monotonic() - t0
    print(f"\n==== demo: {playbook_path.relative_to(REPO)} exited {rc} after {took:.1f}s ====")
    report = newest_report(report_dir, wall0)
    if report is None:
        print(f"no run report written under {report_dir.relative_to(REPO)}")
    else:
        try:
            lines = summarize_report(json.loads(report.read_text(encoding="utf-8")))
        except ValueError:
            lines = []
        print("per class:" if lines else "per class: (report has no `classes` section)")
        for line in lines:
            print(line)
        ramps = summarize_batches(json.loads(report.read_text(encoding="utf-8")))
        if ramps:
            print("ramps (every class over its own hosts, batch n/m of the class):")
            for line in ramps:
                print(line)
        others = sorted(p.name for p in report.parent.glob("report.*") if p != report)
        print(f"report: {report.relative_to(REPO)}" + (f" (also {', '.join(others)})" if others else ""))
    return rc


# ---------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetctl.py", description="simulated GPU fleet")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("create", help="boot and provision the fleet (reuses hosts that are up)")
    p.add_argument("--fleet", default=str(DEFAULT_FLEET))
    p.add_argument("--reset-state", action="store_true", help="rewrite NVML state and sim.json even if present")
    p = sub.add_parser("destroy", help="stop the fleet's hosts")
    p.add_argument("--fleet", default=str(DEFAULT_FLEET))
    p.add_argument("--all", action="store_true", help="also every host any fleet file created")
    p = sub.add_parser("inject", help="inject a fault into one host")
    p.add_argument("host")
    kinds = p.add_subparsers(dest="fault", required=True)
    k = kinds.add_parser("cotenant")
    k.add_argument("--gpu", type=int, required=True)
    k.add_argument("--bytes", dest="size")
    k.add_argument("--pid", type=int)
    k.add_argument("--remove", action="store_true")
    k = kinds.add_parser("gpu-lost")
    k.add_argument("--gpu", type=int, required=True)
    k.add_argument("--clear", action="store_true")
    k = kinds.add_parser("gpu-replaced", help="another card at a GPU index (a new UUID), as after a replacement or reboot")
    k.add_argument("--gpu", type=int, required=True)
    k.add_argument("--clear", action="store_true")
    k = kinds.add_parser("gpu-health", help="an NVML health fault on a GPU (row remapping, uncorrectable ECC errors, retired pages, an Xid)")
    k.add_argument("--gpu", type=int, required=True)
    k.add_argument("--fault", dest="fault_kind", choices=sorted(HEALTH_FAULTS))
    k.add_argument("--xid", type=int, help="the Xid number of --fault xid (default 79)")
    k.add_argument("--clear", action="store_true", help="the fault gone (every health fault without --fault)")
    k = kinds.add_parser("noise", help="free memory of a GPU moves between reads (unstable free memory)")
    k.add_argument("--gpu", type=int, required=True)
    k.add_argument("--bytes", dest="values", help="comma-separated sizes taken from free on successive reads")
    k.add_argument("--clear", action="store_true")
    k = kinds.add_parser("fail-next-boot")
    k.add_argument("--kind", default="oom", choices=FAULT_KINDS)
    k.add_argument("--clear", action="store_true", help="cancel a pending boot failure")
    k = kinds.add_parser("slow-next-boot", help="the next boot is slow and its memory grows while the weights load")
    k.add_argument("--seconds", type=float, default=20.0)
    k.add_argument("--steps", type=int, default=20)
    k.add_argument("--clear", action="store_true")
    k = kinds.add_parser("latency-next-boot", help="the next engine to boot serves slowly (seconds per output token)")
    k.add_argument("--token-delay", type=float, default=0.05)
    k.add_argument("--clear", action="store_true")
    k = kinds.add_parser("unreachable")
    k.add_argument("--clear", action="store_true")
    sub.add_parser("status", help="hosts, GPUs, processes and pending faults as JSON")
    p = sub.add_parser("demo", help="create the fleet and roll out to it")
    p.add_argument("--fleet", default=str(DEFAULT_FLEET))
    p.add_argument("--playbook", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.geteuid() != 0:
        print("fleetctl: error: run as root (test hosts use systemd-nspawn and network namespaces)", file=sys.stderr)
        return 1
    fleet = Fleet(Path(getattr(args, "fleet", DEFAULT_FLEET)))
    try:
        if args.cmd == "create":
            fleet.create(reset_state=args.reset_state)
        elif args.cmd == "destroy":
            fleet.destroy(all_hosts=args.all)
        elif args.cmd == "status":
            print(json.dumps(fleet.status(), indent=2))
        elif args.cmd == "demo":
            return demo(fleet, args.playbook)
        elif args.cmd == "inject":
            if args.fault == "cotenant":
                size = parse_size(args.size, "--bytes") if args.size is not None else None
                fleet.inject_cotenant(args.host, args.gpu, size, args.pid, args.remove)
            elif args.fault == "gpu-lost":
                fleet.inject_gpu_lost(args.host, args.gpu, args.clear)
            elif args.fault == "gpu-replaced":
                fleet.inject_gpu_replaced(args.host, args.gpu, args.clear)
            elif args.fault == "gpu-health":
                fleet.inject_gpu_health(args.host, args.gpu, args.fault_kind, args.clear, args.xid)
            elif args.fault == "noise":
                if not args.clear and not args.values:
                    raise FleetError("noise: --bytes A,B,... is required (unless --clear)")
                values = None if args.clear else [parse_size(v.strip(), "--bytes") for v in args.values.split(",") if v.strip()]
                fleet.inject_noise(args.host, args.gpu, values)
            elif args.fault == "fail-next-boot":
                fleet.inject_fail_next_boot(args.host, None if args.clear else args.kind)
            elif args.fault == "slow-next-boot":
                fleet.inject_slow_next_boot(args.host, None if args.clear else args.seconds, args.steps)
            elif args.fault == "latency-next-boot":
                fleet.inject_latency_next_boot(args.host, None if args.clear else args.token_delay)
            elif args.fault == "unreachable":
                fleet.inject_unreachable(args.host, args.clear)
    except (FleetError, testhosts.HarnessError, nvml_state.StateError) as exc:
        print(f"fleetctl: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
