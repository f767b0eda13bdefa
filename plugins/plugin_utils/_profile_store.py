# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Reference profile store: one YAML file per recorded profile, never overwritten.

Plain Python, no Ansible import (PyYAML is needed; it ships with ansible-core
on the controller, where the store lives).

Layout::

    <store>/.lock                                   flock(2) lock file
    <store>/<host_class>/<host_class>--<key hash>--<UTC timestamp>--<random>.yml

A record file holds::

    format: 2
    host_class: <name>
    key_hash: <16 hex digits, see _compat>
    compat: {canonical key fields}
    recorded_at: 2026-11-29T21:04:09.123456Z
    profile: {the recorded data: ranks (required), vllm_free_bytes, total_bytes, ...}
    record_hash: <sha256 of all the fields above>

Writes take an exclusive lock on ``<store>/.lock``, write a temporary file in
the class directory, fsync it and hard-link it to its final name (which fails
rather than replace an existing file), then remove the temporary name. Reads
take a shared lock. Size strings under keys ending in ``_bytes`` are stored
as integers (``"42GiB"`` -> ``45097156608``). A file that cannot be read or parsed is reported (path and
reason) and skipped; it never hides the other profiles and is never rewritten.

A record is trusted only when it is a regular file (symlinks are not followed), at most
1 MiB, plain YAML without aliases (``&a``/``*a``), valid UTF-8, its ``record_hash``
matches its content, its ``recorded_at`` is not in the future and its profile has
ranks; anything else is reported as unreadable, never used. Format 1 files (without a
``record_hash``) are reported too: their content cannot be checked. Temporary files
left by an interrupted write are removed by the next write (it holds the lock, so no
other write is under way).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import json
import os
import secrets
import stat
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._compat import CompatError, CompatKey, compat_key, diff_keys, key_hash
from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import SizeError, parse_size
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError, class_name

try:
    import yaml
except ImportError:  # pragma: no cover - PyYAML is an ansible-core dependency
    yaml = None  # type: ignore[assignment]  # the module or None: ProfileStore() refuses to open without it

__all__ = ["FORMAT", "ProfileStore", "ProfileStoreError", "validate_host_class"]

FORMAT = 2
# A record is a few KiB; a larger file is not one (and parsing it would cost the query).
MAX_RECORD_BYTES = 1 << 20
# Clock skew tolerated between the host that recorded a profile and the one reading it.
FUTURE_SKEW = datetime.timedelta(minutes=5)
_STAMP = "%Y-%m-%dT%H:%M:%S.%fZ"
_TMP_PREFIX = ".tmp-"


class ProfileStoreError(ValueError):
    """The store or one of its files cannot be used (message names the path)."""


def validate_host_class(host_class: object) -> str:
    try:
        return class_name(host_class, "host_class")
    except ValidationError as exc:
        raise ProfileStoreError(str(exc)) from None


def record_hash(record: Mapping[str, Any]) -> str:
    """sha256 of every field of a record but ``record_hash`` and ``path`` (canonical JSON)."""
    body = {k: v for k, v in record.items() if k not in ("record_hash", "path")}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


if yaml is not None:

    class _PlainLoader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
        """SafeLoader without aliases: a few hundred bytes of nested aliases expand to gigabytes."""

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.events.AliasEvent):
                event = self.peek_event()  # type: ignore[no-untyped-call]  # types-PyYAML leaves Parser.peek_event unannotated
                raise yaml.composer.ComposerError(None, None, "YAML aliases are not allowed in a profile", event.start_mark)
            return super().compose_node(parent, index)


def _read_regular(path: str) -> bytes:
    """The bytes of a regular file, never through a symlink, at most MAX_RECORD_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ProfileStoreError(f"{path}: is a symlink; records must be regular files in the store") from None
        raise ProfileStoreError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ProfileStoreError(f"{path}: not a regular file")
        if st.st_size > MAX_RECORD_BYTES:
            raise ProfileStoreError(f"{path}: {st.st_size} bytes, larger than a record can be ({MAX_RECORD_BYTES})")
        with os.fdopen(fd, "rb") as handle:
            fd = -1
            return handle.read(MAX_RECORD_BYTES + 1)
    except OSError as exc:
        raise ProfileStoreError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        if fd >= 0:
            os.close(fd)


def _has_ranks(profile: Mapping[str, Any]) -> bool:
    """Every rank has its free memory and KV bytes the planner can start from: vLLM's fit suggestion
    (``kv_bytes``) or, from a build that logs none (the CPU build), the bytes the engine allocated
    (``kv_bytes_in_use``, or the profile's ``engine_kv_bytes``), as ``kv_plan`` accepts them."""
    ranks = profile.get("ranks")
    engine = profile.get("engine_kv_bytes") is not None
    return isinstance(ranks, list) and bool(ranks) and all(
        isinstance(r, Mapping) and r.get("free_bytes") is not None
        and (r.get("kv_bytes") is not None or r.get("kv_bytes_in_use") is not None or engine)
        for r in ranks
    )


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class ProfileStore:
    """Directory of reference profiles keyed by host class and compatibility key."""

    def __init__(self, path: str, clock: Callable[[], datetime.datetime] = _utc_now) -> None:
        if yaml is None:  # pragma: no cover
            raise ProfileStoreError("the profile store needs PyYAML (python3-yaml)")
        if not isinstance(path, str) or not path:
            raise ProfileStoreError(f"profile store path must be a non-empty string, got {path!r}")
        self.path = os.path.abspath(path)
        self._clock = clock

    # ------------------------------------------------------------ locking
    @contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        if exclusive:
            try:
                os.makedirs(self.path, mode=0o755, exist_ok=True)
            except OSError as exc:
                raise ProfileStoreError(f"profile store {self.path}: cannot create: {exc.strerror or exc}") from None
        elif not os.path.isdir(self.path):
            yield
            return
        lock_path = os.path.join(self.path, ".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if not exclusive and exc.errno in (errno.EACCES, errno.EROFS):
                # read-only store: readers still work without the lock file
                yield
                return
            raise ProfileStoreError(f"profile store {self.path}: cannot open lock file: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    # ------------------------------------------------------------ reading
    def _class_dir(self, host_class: str) -> str:
        directory = os.path.join(self.path, validate_host_class(host_class))
        if os.path.islink(directory):
            raise ProfileStoreError(f"{directory}: is a symlink; a class directory must be a directory of the store")
        return directory

    def _load(self, path: str, host_class: str) -> dict[str, Any]:
        raw = _read_regular(path)
        try:
            content = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProfileStoreError(f"{path}: not UTF-8 text (byte {exc.start})") from None
        try:
            data = yaml.load(content, Loader=_PlainLoader)  # nosec - a SafeLoader, without aliases
        except yaml.YAMLError as exc:
            reason = " ".join(str(exc).split())
            raise ProfileStoreError(f"{path}: not valid YAML: {reason}") from None
        if not isinstance(data, dict):
            raise ProfileStoreError(f"{path}: expected a mapping with format/host_class/key_hash/compat/profile")
        if data.get("format") == 1:
            raise ProfileStoreError(f"{path}: format 1 has no record_hash, so its content cannot be checked; "
                                    "record the profile again (a profiled canary)")
        if data.get("format") != FORMAT:
            raise ProfileStoreError(f"{path}: unsupported format {data.get('format')!r} (expected {FORMAT})")
        missing = [k for k in ("host_class", "key_hash", "compat", "recorded_at", "profile", "record_hash") if k not in data]
        if missing:
            raise ProfileStoreError(f"{path}: missing {', '.join(missing)}")
        if data["host_class"] != host_class:
            raise ProfileStoreError(f"{path}: records host_class {data['host_class']!r}, found under {host_class!r}")
        if not isinstance(data["profile"], dict) or not isinstance(data["compat"], dict):
            raise ProfileStoreError(f"{path}: compat and profile must be mappings")
        try:
            key = compat_key(data["compat"])
        except CompatError as exc:
            raise ProfileStoreError(f"{path}: {exc}") from None
        if key_hash(key) != data["key_hash"]:
            raise ProfileStoreError(f"{path}: key_hash {data['key_hash']!r} does not match its compat fields ({key_hash(key)}); the file was edited")
        if record_hash(data) != data["record_hash"]:
            raise ProfileStoreError(f"{path}: record_hash does not match its content; the file was edited")
        try:
            when = datetime.datetime.strptime(str(data["recorded_at"]), _STAMP).replace(tzinfo=datetime.timezone.utc)
        except ValueError:
            raise ProfileStoreError(f"{path}: recorded_at {data['recorded_at']!r} is not a UTC time like 2026-11-29T21:04:09.123456Z") from None
        if when > self._clock() + FUTURE_SKEW:
            raise ProfileStoreError(f"{path}: recorded_at {data['recorded_at']} is in the future")
        if not _has_ranks(data["profile"]):
            raise ProfileStoreError(f"{path}: the profile has no ranks (rank, free_bytes, kv_bytes or kv_bytes_in_use)")
        data["recorded_at"] = str(data["recorded_at"])
        data["path"] = path
        return data

    def scan(self, host_class: str) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
        """All readable records of a class, newest first, and the unreadable files (``path``, ``error``)."""
        directory = self._class_dir(host_class)
        records: list[dict[str, Any]] = []
        corrupt: list[dict[str, str]] = []
        with self._locked(exclusive=False):
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                return [], []
            except OSError as exc:
                raise ProfileStoreError(f"{directory}: cannot list: {exc.strerror or exc}") from None
            for name in names:
                if name.startswith(".") or not name.endswith(".yml"):
                    continue
                path = os.path.join(directory, name)
                try:
                    records.append(self._load(path, host_class))
                except ProfileStoreError as exc:
                    corrupt.append({"path": path, "error": str(exc)})
        records.sort(key=lambda r: (r["recorded_at"], os.path.basename(r["path"])), reverse=True)
        corrupt.sort(key=lambda c: c["path"], reverse=True)
        return records, corrupt

    def history(self, host_class: str) -> list[dict[str, Any]]:
        """Readable records of a class, newest first (see :meth:`scan` for the unreadable ones)."""
        return self.scan(host_class)[0]

    def query(self, host_class: str, key: Mapping[str, Any] | CompatKey) -> dict[str, Any]:
        """Newest profile of ``host_class`` recorded under ``key``.

        Returns ``status`` ``found`` (``profile`` is that record), ``mismatch``
        (profiles exist for the class but none under this key: ``profile`` is
        the newest of the class and ``differences`` lists the fields that differ
        from it, reference = stored, current = asked) or ``missing``; plus
        ``key_hash``, ``corrupt`` (unreadable files, never fatal) and ``count``.
        """
        wanted = compat_key(key)
        records, corrupt = self.scan(host_class)
        result: dict[str, Any] = {
            "status": "missing",
            "profile": None,
            "differences": [],
            "key_hash": key_hash(wanted),
            "corrupt": corrupt,
            "count": len(records),
        }
        for record in records:
            if record["key_hash"] == key_hash(wanted):
                result.update(status="found", profile=record)
                return result
        if records:
            newest = records[0]
            result.update(status="mismatch", profile=newest, differences=diff_keys(newest["compat"], wanted))
        return result

    # ------------------------------------------------------------ writing
    def build_record(self, profile: Mapping[str, Any]) -> dict[str, Any]:
        """The record :meth:`record` would write (no ``path``), for check mode and diffs."""
        if not isinstance(profile, Mapping):
            raise ProfileStoreError(f"profile must be a mapping, got {type(profile).__name__}")
        host_class = validate_host_class(profile.get("host_class"))
        if "compat" not in profile:
            raise ProfileStoreError("profile needs compat (the compatibility key fields)")
        try:
            key = compat_key(profile["compat"])
        except CompatError as exc:
            raise ProfileStoreError(str(exc)) from None
        if not key.fields:
            raise ProfileStoreError("compat is empty: a profile must be keyed by at least one field")
        data = profile.get("profile")
        if data is None:
            data = {k: v for k, v in profile.items() if k not in ("host_class", "compat")}
        if not isinstance(data, Mapping) or not data:
            raise ProfileStoreError("profile data must be a non-empty mapping")
        try:
            data = _sizes_to_ints(data, "profile")
        except SizeError as exc:
            raise ProfileStoreError(str(exc)) from None
        if not _has_ranks(data):
            raise ProfileStoreError("profile.ranks: a profile needs a non-empty list of {rank, free_bytes, kv_bytes} "
                                    "(kv_bytes_in_use in place of kv_bytes when the engine logs no suggestion)")
        now = self._clock()
        record: dict[str, Any] = _plain(
            {
                "format": FORMAT,
                "host_class": host_class,
                "key_hash": key_hash(key),
                "compat": key.fields,
                "recorded_at": now.strftime(_STAMP),
                "profile": data,
            }
        )
        try:
            json.dumps(record, allow_nan=False)
        except ValueError:
            raise ProfileStoreError("profile: numbers must be finite (no inf or nan)") from None
        record["record_hash"] = record_hash(record)
        return record

    def dump(self, record: Mapping[str, Any]) -> str:
        body = {k: v for k, v in record.items() if k != "path"}
        text: str = yaml.safe_dump(body, sort_keys=False, default_flow_style=False, allow_unicode=False)
        return text

    def record(self, profile: Mapping[str, Any]) -> dict[str, Any]:
        """Write a new record (``profile`` has ``host_class``, ``compat`` and ``profile``); return it with ``path``."""
        record = self.build_record(profile)
        host_class = record["host_class"]
        stamp = datetime.datetime.strptime(record["recorded_at"], _STAMP).strftime("%Y%m%dT%H%M%S%fZ")
        text = self.dump(record)
        with self._locked(exclusive=True):
            directory = self._class_dir(host_class)
            try:
                os.makedirs(directory, mode=0o755, exist_ok=True)
            except OSError as exc:
                raise ProfileStoreError(f"{directory}: cannot create: {exc.strerror or exc}") from None
            _remove_stale_temporaries(directory)
            try:
                fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".yml", dir=directory)
            except OSError as exc:
                raise ProfileStoreError(f"{directory}: cannot write: {exc.strerror or exc}") from None
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    handle.write(text)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.chmod(tmp, 0o644)
                for _attempt in range(8):
                    name = f"{host_class}--{record['key_hash']}--{stamp}--{secrets.token_hex(4)}.yml"
                    final = os.path.join(directory, name)
                    try:
                        os.link(tmp, final)  # fails instead of replacing an existing file
                        break
                    except FileExistsError:
                        continue
                else:  # pragma: no cover - 8 collisions of 32 random bits
                    raise ProfileStoreError(f"{directory}: could not find a free file name")
            except OSError as exc:
                raise ProfileStoreError(f"{directory}: cannot write profile: {exc.strerror or exc}") from None
            finally:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
            _fsync_dir(directory)
        record["path"] = final
        return record


def _remove_stale_temporaries(directory: str) -> None:
    """Temporary files of interrupted writes (the caller holds the store's exclusive lock)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(_TMP_PREFIX) and name.endswith(".yml"):
            try:
                os.unlink(os.path.join(directory, name))  # a symlink is removed, never followed
            except OSError:
                pass


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _sizes_to_ints(value: Any, where: str) -> Any:
    """Size strings (``"42GiB"``) under keys ending in ``_bytes`` become integers, at any depth."""
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            name = f"{where}.{key}"
            if str(key).endswith("_bytes") and isinstance(item, Mapping):
                out[key] = {k: (parse_size(v, f"{name}.{k}") if isinstance(v, str) else v) for k, v in item.items()}
            elif str(key).endswith("_bytes") and isinstance(item, str):
                text = item.strip()
                out[key] = -parse_size(text[1:], name) if text.startswith("-") else parse_size(text, name)
            else:
                out[key] = _sizes_to_ints(item, name)
        return out
    if isinstance(value, (list, tuple)):
        return [_sizes_to_ints(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _plain(value: Any) -> Any:
    """Deep copy into plain YAML-safe types (Ansible hands over its own str/dict subclasses)."""
    if isinstance(value, Mapping):
        return {(_plain(k) if isinstance(k, (str, int)) else str.__str__(str(k))): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str.__str__(value)  # an exact str, whatever subclass the caller used
    return str.__str__(str(value))
