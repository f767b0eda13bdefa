"""Reader and writer of the fake NVML state file (format v1).

The fake ``libnvidia-ml.so.1`` built from ``fake_nvml.c`` reads this file (named by
``$FAKE_NVML_STATE``, else ``/etc/fake-nvml/state``) on every NVML call that reports
state.  Writers use :func:`save` (atomic: temporary file in the same directory, then
rename) under :func:`locked` (``flock`` on ``<path>.lock``) so that concurrent writers
(a simulated engine registering its processes, a test changing free memory) never
lose each other's changes::

    with nvml_state.locked(path):
        state = nvml_state.load(path)
        nvml_state.add_process(state, gpu=0, pid=4242, used=2 * 1024**3, name="python3")
        nvml_state.save(path, state)

The dict shape returned by :func:`load` and accepted by :func:`save`::

    {
        "system": {
            "driver": "550.127.05",        # nvmlSystemGetDriverVersion
            "cuda": 12040,                 # nvmlSystemGetCudaDriverVersion(_v2)
            "nvml": "12.550.127.05",       # nvmlSystemGetNVMLVersion
            "init_error": 0,               # NVML return code of nvmlInitWithFlags
            "missing": [],                 # NVML function names that return 13
        },
        "gpus": [                          # indices 0..n-1, no gaps, any order
            {
                "index": 0,
                "uuid": "GPU-...",
                "name": "NVIDIA H200",
                "pci": "00000000:18:00.0",  # busId as NVML prints it
                "total": 150754820096,      # bytes
                "reserved": 566231040,      # bytes kept by the driver (v2 struct)
                "base_used": 0,             # bytes used outside any listed process
                "cc": "9.0",                # CUDA compute capability major.minor
                "error": 0,                 # NVML return code of every call on this GPU
                "noise": [],                # bytes taken from free on successive reads
                "free_override": None,      # report this free value verbatim (or None)
                # health (written only when not the default):
                "ecc_mode": 1,              # nvmlDeviceGetEccMode: 1 enabled, 0 disabled
                "ecc_uncorrected_volatile": 0,   # uncorrectable ECC errors since the driver loaded
                "ecc_uncorrected_aggregate": 0,  # over the GPU's life (at least the volatile count)
                "remap_corrected": 0, "remap_uncorrected": 0,  # nvmlDeviceGetRemappedRows: rows remapped
                "remap_pending": 0, "remap_failure": 0,        # 1: a remapping waits for a reset / failed
                "retired_pending": 0,       # nvmlDeviceGetRetiredPagesPendingStatus
                "unsupported": [],          # NVML functions that answer NOT_SUPPORTED (3) on this GPU
                "xid": [],                  # Xid events an event set registered on the GPU receives
            },
        ],
        "procs": [
            {"gpu": 0, "pid": 4242, "used": 1073741824, "kind": "compute", "name": "python3"},
        ],
    }

``kind`` is ``compute``, ``graphics`` or ``both`` (listed by both NVML process calls).
``pidns`` is ``local`` (the default: a process of the reader's pid namespace, listed and
counted only while ``/proc/<pid>`` exists, since the driver frees a dead process's memory)
or ``other`` (a process of another pid namespace, such as a container's co-tenant, which
that ``/proc`` cannot show: listed until its record is removed). :func:`alive` is the rule
the fake library applies.
Memory as reported: ``used = base_used + noise + sum(procs on the GPU)``,
``free = max(0, total - reserved - used)``; the v1 struct reports ``used = total - free``.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from typing import Any, Iterator
from urllib.parse import quote, unquote

FORMAT_VERSION = 1
DEFAULT_PATH = "/etc/fake-nvml/state"

SYSTEM_DEFAULTS: dict[str, Any] = {
    "driver": "550.127.05",
    "cuda": 12040,
    "nvml": "12.550.127.05",
    "init_error": 0,
    "missing": [],
}

GPU_DEFAULTS: dict[str, Any] = {
    "uuid": "",
    "name": "NVIDIA H200",
    "pci": "",
    "total": 0,
    "reserved": 0,
    "base_used": 0,
    "cc": "9.0",
    "error": 0,
    "noise": [],
    "free_override": None,
}
# the health keys: written only when they differ from these (older readers ignore them)
HEALTH_DEFAULTS: dict[str, Any] = {
    "ecc_mode": 1,
    "ecc_uncorrected_volatile": 0,
    "ecc_uncorrected_aggregate": 0,
    "remap_corrected": 0,
    "remap_uncorrected": 0,
    "remap_pending": 0,
    "remap_failure": 0,
    "retired_pending": 0,
    "unsupported": [],
    "xid": [],
}
_HEALTH_LISTS = ("unsupported", "xid")

PROC_KINDS = ("compute", "graphics", "both")
PROC_PIDNS = ("local", "other")
_INT_GPU_KEYS = ("index", "total", "reserved", "base_used", "error")
_INT_PROC_KEYS = ("gpu", "pid", "used")


class StateError(ValueError):
    """The state file or dict is malformed (the message names the line or field)."""


def default_path() -> str:
    """The path the fake library reads: ``$FAKE_NVML_STATE`` or ``/etc/fake-nvml/state``."""
    return os.environ.get("FAKE_NVML_STATE") or DEFAULT_PATH


def new_state() -> dict[str, Any]:
    """An empty state: system defaults, no GPU, no process."""
    return {"system": dict(SYSTEM_DEFAULTS, missing=[]), "gpus": [], "procs": []}


def make_gpu(index: int, total: int, **fields: Any) -> dict[str, Any]:
    """A GPU record with defaults; ``uuid``/``pci`` derived from the index unless given."""
    gpu: dict[str, Any] = dict(GPU_DEFAULTS, noise=[], **_health_defaults())
    gpu.update(
        index=index,
        total=total,
        uuid=f"GPU-00000000-0000-4000-8000-{index:012x}",
        pci=f"00000000:{0x18 + index:02X}:00.0",
    )
    gpu.update(fields)
    return gpu


def _health_defaults() -> dict[str, Any]:
    return {key: list(value) if isinstance(value, list) else value for key, value in HEALTH_DEFAULTS.items()}


def add_process(state: dict[str, Any], gpu: int, pid: int, used: int,
                kind: str = "compute", name: str = "", pidns: str = "local") -> dict[str, Any]:
    """Append a process holding ``used`` bytes on GPU ``gpu``; returns the record.

    ``pidns="other"`` for a process that is not one of the reader's (a co-tenant with a
    made-up pid): a ``local`` record counts only while its pid exists."""
    proc = {"gpu": gpu, "pid": pid, "used": used, "kind": kind, "name": name}
    if pidns != "local":
        proc["pidns"] = pidns
    _check_proc(proc, len(state["procs"]))
    state["procs"].append(proc)
    return proc


def alive(proc: dict[str, Any], proc_root: str = "/proc") -> bool:
    """Whether ``proc`` still holds its memory, as the fake library decides it: a record of
    another pid namespace always; a local one while ``<proc_root>/<pid>`` exists."""
    return proc.get("pidns", "local") == "other" or os.path.exists(os.path.join(proc_root, str(proc["pid"])))


def remove_processes(state: dict[str, Any], pids: set[int] | list[int]) -> int:
    """Drop every process record whose pid is in ``pids``; returns how many went."""
    wanted = set(pids)
    before = len(state["procs"])
    state["procs"] = [p for p in state["procs"] if p["pid"] not in wanted]
    return before - len(state["procs"])


# ---------------------------------------------------------------- encoding

def _enc(value: Any) -> str:
    return quote(str(value), safe=":")


def _enc_list(values: list[Any]) -> str:
    for value in values:
        if "," in str(value):
            raise StateError(f"list item {value!r} must not contain ','")
    return ",".join(_enc(v) for v in values)


def _to_int(value: str, what: str) -> int:
    try:
        number = int(value, 0) if value.lower().startswith("0x") else int(value)
    except ValueError:
        raise StateError(f"{what}: {value!r} is not an integer") from None
    if number < 0:
        raise StateError(f"{what}: {number} is negative")
    return number


def _check_proc(proc: dict[str, Any], pos: int) -> None:
    for key in _INT_PROC_KEYS:
        if not isinstance(proc.get(key), int) or proc[key] < 0:
            raise StateError(f"procs[{pos}].{key}: expected a non-negative integer, got {proc.get(key)!r}")
    if proc.get("kind", "compute") not in PROC_KINDS:
        raise StateError(f"procs[{pos}].kind: {proc.get('kind')!r} is not one of {', '.join(PROC_KINDS)}")
    if proc.get("pidns", "local") not in PROC_PIDNS:
        raise StateError(f"procs[{pos}].pidns: {proc.get('pidns')!r} is not one of {', '.join(PROC_PIDNS)}")


def validate(state: dict[str, Any]) -> None:
    """Raise :class:`StateError` unless ``state`` can be written and read back unchanged."""
    gpus = state.get("gpus", [])
    indices = sorted(g.get("index", -1) for g in gpus)
    if indices != list(range(len(gpus))):
        raise StateError(f"gpus: indices must be 0..{len(gpus) - 1} without gaps or duplicates, got {indices}")
    for gpu in gpus:
        where = f"gpus[index={gpu['index']}]"
        for key in _INT_GPU_KEYS:
            value = gpu.get(key, GPU_DEFAULTS.get(key))
            if not isinstance(value, int) or value < 0:
                raise StateError(f"{where}.{key}: expected a non-negative integer, got {value!r}")
        if gpu.get("free_override") is not None and (not isinstance(gpu["free_override"], int) or gpu["free_override"] < 0):
            raise StateError(f"{where}.free_override: expected a non-negative integer or None")
        for value in gpu.get("noise", []):
            if not isinstance(value, int) or value < 0:
                raise StateError(f"{where}.noise: expected non-negative integers, got {value!r}")
        for key, default in HEALTH_DEFAULTS.items():
            value = gpu.get(key, default)
            if key == "xid":
                if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
                    raise StateError(f"{where}.xid: expected a list of non-negative integers, got {value!r}")
            elif key == "unsupported":
                if not isinstance(value, list) or not all(isinstance(v, str) and v and "," not in v for v in value):
                    raise StateError(f"{where}.unsupported: expected a list of NVML function names, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise StateError(f"{where}.{key}: expected a non-negative integer, got {value!r}")
        cc = str(gpu.get("cc", "9.0")).split(".")
        if len(cc) != 2 or not all(part.isdigit() for part in cc):
            raise StateError(f"{where}.cc: expected MAJOR.MINOR, got {gpu.get('cc')!r}")
    for pos, proc in enumerate(state.get("procs", [])):
        _check_proc(proc, pos)
        if proc["gpu"] >= len(gpus):
            raise StateError(f"procs[{pos}].gpu: no GPU with index {proc['gpu']}")


def dumps(state: dict[str, Any]) -> str:
    """Render ``state`` in format v1."""
    validate(state)
    system = dict(SYSTEM_DEFAULTS, **state.get("system", {}))
    lines = [f"# fake NVML state, format v{FORMAT_VERSION}"]
    lines.append(
        "system driver={} cuda={} nvml={} init_error={} missing={}".format(
            _enc(system["driver"]), int(system["cuda"]), _enc(system["nvml"]),
            int(system["init_error"]), _enc_list(list(system["missing"])),
        )
    )
    for gpu in sorted(state.get("gpus", []), key=lambda g: g["index"]):
        full = dict(GPU_DEFAULTS, **gpu)
        tokens = [
            f"index={full['index']}", f"uuid={_enc(full['uuid'])}", f"name={_enc(full['name'])}",
            f"pci={_enc(full['pci'])}", f"total={full['total']}", f"reserved={full['reserved']}",
            f"base_used={full['base_used']}", f"cc={_enc(full['cc'])}", f"error={full['error']}",
            f"noise={_enc_list(list(full['noise']))}",
        ]
        if full.get("free_override") is not None:
            tokens.append(f"free_override={full['free_override']}")
        if full.get("pci_id") is not None:
            tokens.append(f"pci_id={int(full['pci_id'])}")
        for key, default in HEALTH_DEFAULTS.items():
            value = gpu.get(key, default)
            if value != default:
                tokens.append(f"{key}={_enc_list(list(value)) if key in _HEALTH_LISTS else int(value)}")
        lines.append("gpu " + " ".join(tokens))
    for proc in state.get("procs", []):
        line = "proc gpu={} pid={} used={} kind={} name={}".format(
            proc["gpu"], proc["pid"], proc["used"], proc.get("kind", "compute"), _enc(proc.get("name", ""))
        )
        if proc.get("pidns", "local") != "local":
            line += f" pidns={proc['pidns']}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def loads(text: str, source: str = "<state>") -> dict[str, Any]:
    """Parse format v1 text; unknown record types and keys are ignored."""
    state = new_state()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].split()
        if not line:
            continue
        rtype, tokens = line[0], line[1:]
        fields: dict[str, str] = {}
        for token in tokens:
            if "=" not in token:
                raise StateError(f"{source}:{lineno}: token {token!r} is not key=value")
            key, value = token.split("=", 1)
            fields[key] = value
        where = f"{source}:{lineno}"
        if rtype == "system":
            system = state["system"]
            for key, value in fields.items():
                if key in ("driver", "nvml"):
                    system[key] = unquote(value)
                elif key in ("cuda", "init_error"):
                    system[key] = _to_int(unquote(value), f"{where}: {key}")
                elif key == "missing":
                    system[key] = [v for v in unquote(value).split(",") if v]
        elif rtype == "gpu":
            gpu: dict[str, Any] = dict(GPU_DEFAULTS, noise=[], **_health_defaults())
            if "index" not in fields:
                raise StateError(f"{where}: gpu record without index=")
            for key, value in fields.items():
                if key in _INT_GPU_KEYS or key == "pci_id":
                    gpu[key] = _to_int(unquote(value), f"{where}: {key}")
                elif key == "free_override":
                    gpu[key] = _to_int(unquote(value), f"{where}: {key}") if value else None
                elif key == "noise":
                    gpu[key] = [_to_int(v, f"{where}: noise") for v in unquote(value).split(",") if v]
                elif key == "xid":
                    gpu[key] = [_to_int(v, f"{where}: xid") for v in unquote(value).split(",") if v]
                elif key == "unsupported":
                    gpu[key] = [v for v in unquote(value).split(",") if v]
                elif key in HEALTH_DEFAULTS:
                    gpu[key] = _to_int(unquote(value), f"{where}: {key}")
                else:
                    gpu[key] = unquote(value)
            state["gpus"].append(gpu)
        elif rtype == "proc":
            proc: dict[str, Any] = {"kind": "compute", "name": ""}
            for key, value in fields.items():
                if key in _INT_PROC_KEYS:
                    proc[key] = _to_int(unquote(value), f"{where}: {key}")
                else:
                    proc[key] = unquote(value)
            for key in _INT_PROC_KEYS:
                if key not in proc:
                    raise StateError(f"{where}: proc record without {key}=")
            state["procs"].append(proc)
    state["gpus"].sort(key=lambda g: g["index"])
    try:
        validate(state)
    except StateError as exc:
        raise StateError(f"{source}: {exc}") from None
    return state


def load(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Read and parse the state file (``default_path()`` when ``path`` is None)."""
    path = os.fspath(path) if path is not None else default_path()
    with open(path, encoding="utf-8") as handle:
        return loads(handle.read(), source=path)


def save(path: str | os.PathLike[str] | None, state: dict[str, Any], mode: int = 0o644) -> None:
    """Write ``state`` atomically: a temporary file beside ``path``, fsync, rename."""
    path = os.fspath(path) if path is not None else default_path()
    text = dumps(state)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".state.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(path: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<path>.lock`` for a read-modify-write of the state."""
    path = os.fspath(path) if path is not None else default_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """``python3 nvml_state.py PATH`` validates a state file and prints it back normalised."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    try:
        print(dumps(load(args[0] if args else None)), end="")
    except (OSError, StateError) as exc:
        print(f"nvml_state: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
