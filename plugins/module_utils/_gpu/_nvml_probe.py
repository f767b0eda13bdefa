# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Per-GPU memory probe through NVML (the ``pynvml`` binding is injected).

Plain Python with no Ansible import: the ``gpu_memory_info`` module and the real-GPU
check script both call :func:`probe`.  The binding object only needs the pynvml
function names used here and an ``NVMLError`` class whose instances carry ``value``
(the NVML return code), so tests pass a fake object.
"""
from __future__ import annotations

import os
import subprocess
import time
from typing import Any, Callable, Iterable, Sequence

from ._gpu_health import read_health

# NVML return codes (nvml.h)
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25

NVML_MEMORY_V2 = 0x02000028
NVML_VALUE_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF

RunCommand = Callable[[Sequence[str]], "tuple[int, str, str]"]


class NvmlProbeError(Exception):
    """A probe failure with a message that names the host and, when known, the GPU."""

    def __init__(self, message: str, gpu: str | None = None, code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.gpu = gpu
        self.code = code

    def __str__(self) -> str:
        return self.message


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


_CODE_HINTS = {
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML library libnvidia-ml.so.1 not found: is the NVIDIA driver installed?",
    NVML_ERROR_DRIVER_NOT_LOADED: "NVIDIA driver not loaded (NVML_ERROR_DRIVER_NOT_LOADED): is the kernel module loaded?",
    NVML_ERROR_NO_PERMISSION: "no permission to query NVML (NVML_ERROR_NO_PERMISSION): run as a user allowed to open /dev/nvidia*",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost (NVML_ERROR_GPU_IS_LOST): it fell off the bus; the host needs attention",
    NVML_ERROR_RESET_REQUIRED: "GPU requires a reset (NVML_ERROR_RESET_REQUIRED)",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "NVML library and kernel driver versions differ (NVML_ERROR_LIB_RM_VERSION_MISMATCH): reboot or reload the driver",
    NVML_ERROR_UNINITIALIZED: "NVML is not initialized (NVML_ERROR_UNINITIALIZED)",
}


def describe_error(exc: BaseException) -> str:
    """A one-line explanation of an NVML error (code and hint, no traceback)."""
    code = _code(exc)
    if code in _CODE_HINTS:
        return _CODE_HINTS[code]
    try:
        text = str(exc)
    except Exception:  # pylint: disable=broad-except  # the binding's __str__ may call into NVML
        text = type(exc).__name__
    return f"NVML error {code}: {text}" if code is not None else text


# ---------------------------------------------------------------- own processes

def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def process_name(pid: int, proc_root: str = "/proc") -> str | None:
    """``/proc/<pid>/comm`` without the newline, or None when unreadable."""
    comm = _read(os.path.join(proc_root, str(pid), "comm"))
    return comm.strip() if comm is not None else None


def parent_pid(pid: int, proc_root: str = "/proc") -> int | None:
    """The parent pid from ``/proc/<pid>/stat``, or None when the process is gone."""
    stat = _read(os.path.join(proc_root, str(pid), "stat"))
    if not stat:
        return None
    # comm may hold spaces and parentheses: the fields after the last ')' are fixed.
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[1]) if len(fields) >= 2 and fields[1].isdigit() else None


class OwnProcesses:
    """Which pids belong to this host's own engine: the roots (unit control-group members,
    unit main pids, explicit pids) and every process below one of them.

    Only the pids asked about are resolved, by walking up their parent chain in /proc,
    so the cost follows the number of GPU processes, not of all processes on the host.
    """

    def __init__(self, roots: Iterable[int], proc_root: str = "/proc") -> None:
        self.roots = {int(pid) for pid in roots if int(pid) > 0}
        self.proc_root = proc_root
        self._known: dict[int, bool] = {pid: True for pid in self.roots}

    def __contains__(self, pid: object) -> bool:
        if not isinstance(pid, int) or pid <= 0:
            return False
        chain: list[int] = []
        current: int | None = pid
        verdict = False
        while current is not None and current > 0 and len(chain) < 4096:
            if current in self._known:
                verdict = self._known[current]
                break
            if current == 1:  # init is nobody's descendant
                break
            chain.append(current)
            current = parent_pid(current, self.proc_root)
        for seen in chain:
            self._known[seen] = verdict
        return verdict

    def found(self) -> list[int]:
        """Roots and every pid found to be below one, sorted."""
        return sorted(pid for pid, own in self._known.items() if own)


def cgroup_pids(control_group: str, cgroup_root: str = "/sys/fs/cgroup") -> set[int]:
    """Every pid in ``control_group`` and its sub-groups (cgroup v2, or v1 ``systemd`` tree)."""
    pids: set[int] = set()
    relative = control_group.strip("/")
    for base in (os.path.join(cgroup_root, relative), os.path.join(cgroup_root, "systemd", relative)):
        if not os.path.isdir(base):
            continue
        for directory, _subdirs, files in os.walk(base):
            if "cgroup.procs" in files:
                for line in (_read(os.path.join(directory, "cgroup.procs")) or "").split():
                    if line.isdigit():
                        pids.add(int(line))
        break
    return pids


def _default_run(argv: Sequence[str]) -> tuple[int, str, str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, "", str(exc)
    return done.returncode, done.stdout, done.stderr


def unit_processes(unit: str, run_command: RunCommand | None = None,
                   cgroup_root: str = "/sys/fs/cgroup", warnings: list[str] | None = None) -> tuple[int, set[int]]:
    """(MainPID, pids of the unit's control group) of one systemd unit; a unit systemd
    does not know adds a warning (its memory cannot be counted as own)."""
    run = run_command or _default_run
    rc, out, err = run(["systemctl", "show", "-p", "ControlGroup,MainPID,LoadState", "--", unit])
    if rc != 0:
        raise NvmlProbeError(f"cannot read systemd unit {unit!r} (systemctl show rc={rc}): {err.strip() or out.strip()}")
    props: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            props[key.strip()] = value.strip()
    main_pid = int(props["MainPID"]) if props.get("MainPID", "").isdigit() else 0
    group = props.get("ControlGroup", "")
    if props.get("LoadState") == "not-found" and warnings is not None:
        warnings.append(f"systemd unit {unit!r} not found: no process counts as own through it")
    return main_pid, (cgroup_pids(group, cgroup_root) if group else set())


def own_processes(service_units: Sequence[str] = (), service_pids: Sequence[int] = (),
                  run_command: RunCommand | None = None, proc_root: str = "/proc",
                  cgroup_root: str = "/sys/fs/cgroup", warnings: list[str] | None = None) -> OwnProcesses:
    """This host's own engine processes: the units' control-group members and main pids
    and the explicit pids, each with every process below it."""
    roots: set[int] = {int(pid) for pid in service_pids if int(pid) > 0}
    for unit in service_units:
        main_pid, members = unit_processes(unit, run_command, cgroup_root, warnings)
        if main_pid > 0:
            roots.add(main_pid)
        roots |= members
    return OwnProcesses(roots, proc_root)


# ---------------------------------------------------------------- probe

class _Session:
    """One NVML session: wraps binding calls so that errors name the host and GPU."""

    def __init__(self, nvml: Any, host: str, warnings: list[str]) -> None:
        self.nvml = nvml
        self.host = host
        self.warnings = warnings
        self.error_type: type[BaseException] = getattr(nvml, "NVMLError", Exception)

    def where(self, gpu: str | None) -> str:
        return f"{self.host}: GPU {gpu}" if gpu else self.host

    def fail(self, exc: BaseException, gpu: str | None, what: str) -> NvmlProbeError:
        return NvmlProbeError(f"{self.where(gpu)}: {what}: {describe_error(exc)}", gpu=gpu, code=_code(exc))

    def call(self, name: str, *args: Any, gpu: str | None = None, what: str | None = None, **kwargs: Any) -> Any:
        func = getattr(self.nvml, name, None)
        if func is None:
            raise NvmlProbeError(f"{self.where(gpu)}: the NVML binding has no {name}()", gpu=gpu,
                                 code=NVML_ERROR_FUNCTION_NOT_FOUND)
        try:
            return func(*args, **kwargs)
        except self.error_type as exc:  # pylint: disable=catching-non-exception
            raise self.fail(exc, gpu, what or name) from None

    def optional(self, name: str, *args: Any, gpu: str | None = None, field: str) -> Any:
        """Call an NVML function whose absence only degrades the result (field omitted)."""
        try:
            return self.call(name, *args, gpu=gpu)
        except NvmlProbeError as exc:
            if exc.code in (NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_NOT_SUPPORTED):
                self.warnings.append(f"{self.where(gpu)}: {field} not reported ({name}: {describe_error_code(exc.code)})")
                return None
            raise


def describe_error_code(code: int | None) -> str:
    return {NVML_ERROR_FUNCTION_NOT_FOUND: "function not found in this driver",
            NVML_ERROR_NOT_SUPPORTED: "not supported on this GPU"}.get(code or 0, f"NVML error {code}")


def _parse_device(spec: Any) -> int | str:
    if isinstance(spec, bool):
        raise NvmlProbeError(f"devices: {spec!r} is neither a GPU index nor a GPU UUID")
    if isinstance(spec, int):
        if spec < 0:
            raise NvmlProbeError(f"devices: GPU index {spec} is negative")
        return spec
    text = str(spec).strip()
    if text.isdigit():
        return int(text)
    if text.startswith(("GPU-", "MIG-")):
        return text
    raise NvmlProbeError(f"devices: {spec!r} is neither a GPU index nor a GPU UUID (GPU-...)")


def _select(session: _Session, devices: Sequence[Any] | None) -> list[tuple[int, Any]]:
    count = session.call("nvmlDeviceGetCount", what="counting GPUs")
    if devices is None:
        return [(index, session.call("nvmlDeviceGetHandleByIndex", index, gpu=str(index), what="opening the GPU"))
                for index in range(count)]
    chosen: list[tuple[int, Any]] = []
    seen: dict[int, Any] = {}
    for spec in devices:
        wanted = _parse_device(spec)
        if isinstance(wanted, int):
            if wanted >= count:
                listing = f"0-{count - 1}" if count else "none"
                raise NvmlProbeError(f"{session.host}: GPU {wanted} does not exist ({count} GPUs, indices {listing})",
                                     gpu=str(wanted))
            index = wanted
            handle = session.call("nvmlDeviceGetHandleByIndex", index, gpu=str(index), what="opening the GPU")
        else:
            try:
                handle = session.call("nvmlDeviceGetHandleByUUID", wanted, gpu=wanted, what="opening the GPU")
            except NvmlProbeError as exc:
                if exc.code in (NVML_ERROR_NOT_FOUND, NVML_ERROR_INVALID_ARGUMENT):
                    raise NvmlProbeError(f"{session.host}: GPU {wanted} not found on this host", gpu=wanted) from None
                raise
            index = int(session.call("nvmlDeviceGetIndex", handle, gpu=wanted, what="reading the GPU index"))
        if index in seen:
            raise NvmlProbeError(f"{session.host}: devices: GPU {index} is listed twice ({seen[index]!r} and {spec!r})",
                                 gpu=str(index))
        seen[index] = spec
        chosen.append((index, handle))
    return chosen


def _memory(session: _Session, handle: Any, label: str, use_v2: bool) -> tuple[dict[str, int | None], bool]:
    """One memory reading: (figures, whether v2 was used)."""
    if use_v2:
        version = getattr(session.nvml, "nvmlMemory_v2", NVML_MEMORY_V2)
        try:
            mem = session.call("nvmlDeviceGetMemoryInfo", handle, version=version, gpu=label, what="reading memory (v2)")
            return ({"total": int(mem.total), "free": int(mem.free), "used": int(mem.used),
                     "reserved": int(mem.reserved)}, True)
        except NvmlProbeError as exc:
            if exc.code not in (NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
                                NVML_ERROR_NOT_SUPPORTED):
                raise
            session.warnings.append(
                f"{session.where(label)}: nvmlDeviceGetMemoryInfo_v2 unavailable ({describe_error_code(exc.code)}"
                f"{'' if exc.code != NVML_ERROR_ARGUMENT_VERSION_MISMATCH else ': version mismatch'}); "
                "using v1, where used includes the driver's reserved memory and reserved_bytes is unknown")
    mem = session.call("nvmlDeviceGetMemoryInfo", handle, gpu=label, what="reading memory")
    return {"total": int(mem.total), "free": int(mem.free), "used": int(mem.used), "reserved": None}, False


def _check_figures(host: str, label: str, mem: dict[str, int | None]) -> None:
    total = mem["total"] or 0
    problems = []
    if total <= 0:
        problems.append(f"total {total}")
    for key in ("free", "used", "reserved"):
        value = mem[key]
        if value is not None and value > total:
            problems.append(f"{key} {value} > total {total}")
    if problems:
        raise NvmlProbeError(f"{host}: GPU {label}: NVML reports impossible memory figures ({', '.join(problems)}); "
                             "the driver or GPU is in a bad state", gpu=label)


_PROCESS_CALLS = (
    ("compute", ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")),
    ("graphics", ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2")),
)


def _processes(session: _Session, handle: Any, label: str, own: OwnProcesses,
               proc_root: str) -> list[dict[str, Any]] | None:
    by_pid: dict[int, dict[str, Any]] = {}
    listed_any = False
    for kind, names in _PROCESS_CALLS:
        infos = None
        for name in names:
            if getattr(session.nvml, name, None) is None:
                continue
            try:
                infos = session.call(name, handle, gpu=label, what=f"listing {kind} processes")
                break
            except NvmlProbeError as exc:
                if exc.code != NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
        if infos is None:
            session.warnings.append(f"{session.where(label)}: {kind} processes not reported "
                                    f"({' / '.join(names)}: function not found in this driver)")
            continue
        listed_any = True
        for info in infos:
            pid = int(info.pid)
            used = info.usedGpuMemory
            used_bytes = None if used is None or int(used) == NVML_VALUE_NOT_AVAILABLE else int(used)
            entry = by_pid.get(pid)
            if entry is None:
                by_pid[pid] = {"pid": pid, "name": process_name(pid, proc_root), "used_bytes": used_bytes,
                               "kinds": [kind], "own": pid in own}
            else:
                if kind not in entry["kinds"]:
                    entry["kinds"].append(kind)
                if used_bytes is not None and (entry["used_bytes"] is None or used_bytes > entry["used_bytes"]):
                    entry["used_bytes"] = used_bytes
    if not listed_any:
        return None
    return sorted(by_pid.values(), key=lambda p: p["pid"])


def probe(nvml: Any, devices: Sequence[Any] | None = None, samples: int = 1, interval: float = 0.0,
          service_units: Sequence[str] = (), service_pids: Sequence[int] = (), host: str = "localhost",
          run_command: RunCommand | None = None, proc_root: str = "/proc",
          cgroup_root: str = "/sys/fs/cgroup", sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Probe the GPUs and return ``{gpus, driver_version, cuda_driver_version, nvml_version,
    own_pids, warnings}``.  Raises :class:`NvmlProbeError` with a message naming the host and
    GPU on any failure that makes the figures unusable."""
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise NvmlProbeError(f"samples must be an integer >= 1, got {samples!r}")
    if interval < 0:
        raise NvmlProbeError(f"interval must be >= 0 seconds, got {interval!r}")
    devices = list(devices) if devices else None  # none or empty: every GPU
    warnings: list[str] = []
    unit_warnings: list[str] = []
    own = own_processes(service_units, service_pids, run_command, proc_root, cgroup_root, unit_warnings)
    warnings.extend(f"{host}: {text}" for text in unit_warnings)
    session = _Session(nvml, host, warnings)
    try:
        init = nvml.nvmlInit
        init()
    except session.error_type as exc:  # pylint: disable=catching-non-exception
        raise NvmlProbeError(f"{host}: {describe_error(exc)}", code=_code(exc)) from None
    except OSError as exc:
        raise NvmlProbeError(f"{host}: {_CODE_HINTS[NVML_ERROR_LIBRARY_NOT_FOUND]} ({exc})",
                             code=NVML_ERROR_LIBRARY_NOT_FOUND) from None
    try:
        result = _probe(session, devices, samples, interval, own, proc_root, sleep)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # pylint: disable=broad-except  # shutdown failure must not hide the result
            pass
    result["own_pids"] = own.found()
    result["warnings"] = warnings
    return result


def _probe(session: _Session, devices: Sequence[Any] | None, samples: int, interval: float,
           own: OwnProcesses, proc_root: str, sleep: Callable[[float], None]) -> dict[str, Any]:
    host = session.host
    driver = session.optional("nvmlSystemGetDriverVersion", field="driver_version")
    cuda = None
    try:
        cuda = session.call("nvmlSystemGetCudaDriverVersion_v2")
    except NvmlProbeError as exc:
        if exc.code != NVML_ERROR_FUNCTION_NOT_FOUND:
            raise
        cuda = session.optional("nvmlSystemGetCudaDriverVersion", field="cuda_driver_version")
    nvml_version = session.optional("nvmlSystemGetNVMLVersion", field="nvml_version")

    chosen = _select(session, devices)
    gpus: list[dict[str, Any]] = []
    handles: list[tuple[Any, str, bool]] = []
    for index, handle in chosen:
        label = str(index)
        uuid = _text(session.call("nvmlDeviceGetUUID", handle, gpu=label, what="reading the UUID"))
        label = f"{index} ({uuid})"
        name = session.optional("nvmlDeviceGetName", handle, gpu=label, field="name")
        pci = session.optional("nvmlDeviceGetPciInfo", handle, gpu=label, field="pci_bus_id")
        cc = session.optional("nvmlDeviceGetCudaComputeCapability", handle, gpu=label, field="compute_capability")
        gpu: dict[str, Any] = {"index": index, "uuid": uuid}
        if name is not None:
            gpu["name"] = _text(name)
        if pci is not None:
            gpu["pci_bus_id"] = _text(pci.busId)
        if cc is not None:
            gpu["compute_capability"] = f"{int(cc[0])}.{int(cc[1])}"
        gpus.append(gpu)
        handles.append((handle, label, True))

    readings: list[list[dict[str, int | None]]] = [[] for _gpu in gpus]
    for sample in range(samples):
        if sample and interval:
            sleep(interval)
        for pos, (handle, label, use_v2) in enumerate(handles):
            mem, used_v2 = _memory(session, handle, label, use_v2)
            handles[pos] = (handle, label, used_v2)
            _check_figures(host, label, mem)
            readings[pos].append(mem)

    for pos, gpu in enumerate(gpus):
        handle, label, used_v2 = handles[pos]
        last = readings[pos][-1]
        frees = [int(r["free"] or 0) for r in readings[pos]]
        processes = _processes(session, handle, label, own, proc_root)
        own_used = sum(p["used_bytes"] or 0 for p in processes or () if p["own"])
        total = int(last["total"] or 0)
        # The lowest sample, not the last: a dip seen while sampling is what a boot may meet.
        boot_free = min(frees) + own_used
        if boot_free > total:
            session.warnings.append(f"{session.where(label)}: free + own processes ({boot_free}) exceeds total "
                                    f"({total}); boot_free_bytes capped at total")
            boot_free = total
        gpu.update({
            "total_bytes": total,
            "free_bytes": int(last["free"] or 0),
            "used_bytes": int(last["used"] or 0),
            "reserved_bytes": last["reserved"],
            "memory_info_version": 2 if used_v2 else 1,
            "free_min_bytes": min(frees),
            "free_max_bytes": max(frees),
            "samples": len(frees),
            "own_used_bytes": own_used,
            "boot_free_bytes": boot_free,
            "processes": processes if processes is not None else [],
            "processes_reported": processes is not None,
            # ECC, row remapping, retired pages: what each query answered (not supported is no error)
            "health": read_health(session.nvml, handle),
        })
    return {
        "gpus": gpus,
        "driver_version": _text(driver) if driver is not None else None,
        "cuda_driver_version": _cuda_text(cuda),
        "nvml_version": _text(nvml_version) if nvml_version is not None else None,
    }


def _cuda_text(value: Any) -> str | None:
    """12040 -> '12.4' (NVML encodes major*1000 + minor*10)."""
    if value is None:
        return None
    number = int(value)
    return f"{number // 1000}.{(number % 1000) // 10}"
