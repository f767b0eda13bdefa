# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The host tools of the vLLM units, installed in one call (gpufleet.vllm.vllm_host_tools).

The boot gate, its library, the metrics exporter and the exporter's systemd units are a
dozen files; a task per file costs a dozen round trips on every host's first deploy, and
another call to find out, at every later deploy, whether they are still the ones to
install. Here the role sends every file's content in one call, and each file is compared
with the one on disk (content, owner ``root:root``, mode) and written atomically only when
it differs, so an edited or removed file comes back and an unchanged host changes nothing.

Plain Python with no Ansible import; ``systemctl`` and the interpreter that compiles the
library run through the caller's runner (the module's ``run_command``). ``apply`` is the
whole install, for gpufleet.vllm.vllm_host_tools and for gpufleet.vllm.vllm_unit's
``host_tools`` option, which installs them in the same round trip as the units that use them.
"""

from __future__ import annotations

import compileall
import contextlib
import io
import os
import sys
import typing as t
from dataclasses import dataclass

from .. import _validate as v
from ._unit_files import UnitFilesError, ensure_dir, ensure_file

__all__ = ["ARGUMENT_SPEC", "HostToolsError", "ToolDir", "ToolFile", "apply", "compile_dir", "install", "parse_dirs", "parse_files",
           "start_units", "under", "units_of"]

# The options of vllm_host_tools, and the suboptions of vllm_unit's host_tools.
ARGUMENT_SPEC: dict[str, t.Any] = {
    "files": {"type": "list", "elements": "dict", "required": True, "options": {
        "path": {"type": "path", "required": True},
        "content": {"type": "str", "required": True},
        "mode": {"type": "str", "default": "0644"},
    }},
    "directories": {"type": "list", "elements": "dict", "default": [], "options": {
        "path": {"type": "path", "required": True},
        "mode": {"type": "str", "default": "0755"},
    }},
    "compile": {"type": "list", "elements": "path", "default": []},
    "python": {"type": "path"},
    "units": {"type": "list", "elements": "str", "default": []},
}

Runner = t.Callable[[t.List[str]], t.Tuple[int, str, str]]


class HostToolsError(ValueError):
    """Bad input or a file that cannot be written; the message names the field or the path."""


@dataclass(frozen=True)
class ToolFile:
    path: str
    content: bytes
    mode: int


@dataclass(frozen=True)
class ToolDir:
    path: str
    mode: int


def _mode(value: t.Any, field: str) -> int:
    word = v.text(value, field)
    if not word.isdigit() or len(word) > 4 or any(c > "7" for c in word):
        raise HostToolsError(f"{field}: an octal file mode such as '0644' (a quoted string), got {word!r}")
    return int(word, 8)


def parse_files(raw: t.Sequence[t.Mapping[str, t.Any]], field: str = "files") -> list[ToolFile]:
    """``[{path, content, mode}]``: absolute paths, each once; ``content`` text (``mode`` default 0644)."""
    out = []
    try:
        for i, item in enumerate(raw):
            where = f"{field}[{i}]"
            path = v.abs_path(item.get("path"), f"{where}.path")
            content = item.get("content")
            if not isinstance(content, str):
                raise HostToolsError(f"{where}.content: expected the file's text, got {type(content).__name__}")
            out.append(ToolFile(path, content.encode("utf-8"), _mode(item.get("mode") or "0644", f"{where}.mode")))
        v.unique([f.path for f in out], f"{field}[].path")
    except v.ValidationError as exc:
        raise HostToolsError(str(exc)) from None
    return out


def parse_dirs(raw: t.Sequence[t.Mapping[str, t.Any]], field: str = "directories") -> list[ToolDir]:
    """``[{path, mode}]``: absolute paths, each once (``mode`` default 0755)."""
    out = []
    try:
        for i, item in enumerate(raw):
            where = f"{field}[{i}]"
            out.append(ToolDir(v.abs_path(item.get("path"), f"{where}.path"), _mode(item.get("mode") or "0755", f"{where}.mode")))
        v.unique([d.path for d in out], f"{field}[].path")
    except v.ValidationError as exc:
        raise HostToolsError(str(exc)) from None
    return out


def _parents(path: str, check: bool) -> bool:
    """Create the missing parent directories of ``path`` (root, 0755); True if any was missing."""
    parent = os.path.dirname(path)
    missing = []
    while parent and parent != "/" and not os.path.isdir(parent):
        if os.path.lexists(parent):
            raise HostToolsError(f"{parent}: exists and is not a directory (needed for {path})")
        missing.append(parent)
        parent = os.path.dirname(parent)
    if not check:
        for directory in reversed(missing):
            try:
                os.mkdir(directory, 0o755)
            except FileExistsError:
                pass
            except OSError as exc:
                raise HostToolsError(f"{directory}: cannot create: {exc.strerror or exc}") from None
    return bool(missing)


def install(files: t.Sequence[ToolFile], directories: t.Sequence[ToolDir], check: bool,
            uid: int = 0, gid: int = 0) -> list[str]:
    """Make every directory and file as given (files owned by ``uid:gid``, root by default); returns
    the paths that changed, in order."""
    changed = []
    try:
        for directory in directories:
            parents = _parents(directory.path, check)
            if check and parents:
                changed.append(directory.path)  # its parents are missing: it is too
            # an existing directory keeps its owner: the textfile collector directory, for one,
            # may belong to node_exporter
            elif ensure_dir(directory.path, uid, gid, directory.mode, check, keep_owner=True):
                changed.append(directory.path)
        for item in files:
            missing = _parents(item.path, check)
            if (check and missing) or ensure_file(item.path, item.content, uid, gid, item.mode, check):
                changed.append(item.path)
    except UnitFilesError as exc:
        raise HostToolsError(str(exc)) from None
    return changed


def under(paths: t.Iterable[str], directory: str) -> bool:
    """Is any of ``paths`` inside ``directory``?"""
    prefix = directory.rstrip("/") + "/"
    return any(p.startswith(prefix) for p in paths)


def _compiled(directory: str) -> bool:
    """Every .py file of ``directory`` and of its subfolders (the gate library's subpackages) has a
    compiled file in its folder's __pycache__."""
    for folder, subfolders, files in os.walk(directory):
        subfolders[:] = [s for s in subfolders if s != "__pycache__"]
        cache = os.path.join(folder, "__pycache__")
        names = os.listdir(cache) if os.path.isdir(cache) else []
        sources = [n[:-3] for n in files if n.endswith(".py")]
        if not all(any(n.startswith(src + ".") and n.endswith(".pyc") for n in names) for src in sources):
            return False
    return True


def _run(run: Runner, argv: list[str], what: str) -> None:
    """Run ``argv``; a failure names ``what`` ran and its error output (or exit status)."""
    rc, out, err = run(argv)
    if rc != 0:
        raise HostToolsError(f"{what}: {(err or out).strip() or f'exit {rc}'}")


def compile_dir(run: Runner, python: str, directory: str) -> None:
    """Byte-compile ``directory`` for ``python``: in this process when ``python`` is this
    process's interpreter (a host whose engine venv links to the system python, the usual
    case: starting another interpreter would cost a host's deploy a process start for the
    same files), else with ``python -m compileall``."""
    what = f"compile {directory} with {python}"
    if not sys.executable or os.path.realpath(python) != os.path.realpath(sys.executable):
        _run(run, [python, "-m", "compileall", "-q", directory], what)
        return
    # compileall prints what failed on stdout, which is the module's JSON result: keep it aside
    errors = io.StringIO()
    try:
        with contextlib.redirect_stdout(errors):
            compiled = compileall.compile_dir(directory, quiet=1)
    except Exception as exc:  # pylint: disable=broad-exception-caught
        # what the other interpreter's non-zero exit would say: the caller keeps its context (snapshot, stop)
        raise HostToolsError(f"{what}: {type(exc).__name__}: {exc}") from None
    if not compiled:
        raise HostToolsError(f"{what}: {errors.getvalue().strip() or 'compileall failed'}")


def apply(params: t.Mapping[str, t.Any], run: Runner, systemctl: str, check: bool, start: bool = True) -> dict[str, t.Any]:
    """Install ``params`` (``ARGUMENT_SPEC``'s options): directories and files, then compile the
    ``compile`` directories where a file changed or a compiled file is missing, then enable and
    start the ``units`` (reloading systemd and restarting them after any change). Returns
    ``{written, compiled, started, changed}``; in check mode only says what it would do.

    ``start=False`` leaves the units to :func:`start_units`, for a caller that reloads systemd
    itself in between (vllm_unit writes the instances' units and reloads once for both)."""
    files = parse_files(params["files"])
    directories = parse_dirs(params.get("directories") or [])
    units_of(params)
    python: str = params.get("python") or ""
    if params.get("compile") and not python:
        raise HostToolsError("python: required with compile (the interpreter that runs the compiled files)")
    written = install(files, directories, check)
    result: dict[str, t.Any] = {"written": written, "compiled": [], "started": []}
    for directory in params.get("compile") or []:
        if not under(written, directory) and _compiled(directory):
            continue
        result["compiled"].append(directory)
        if not check:
            compile_dir(run, python, directory)
    if start:
        start_units(params, result, run, systemctl, check)
    result["changed"] = bool(written or result["compiled"] or result["started"])
    return result


def units_of(params: t.Mapping[str, t.Any]) -> list[str]:
    """The ``units`` of ``params``, checked."""
    try:
        return [v.systemd_unit_name(u, f"units[{i}]") for i, u in enumerate(params.get("units") or [])]
    except v.ValidationError as exc:
        raise HostToolsError(str(exc)) from None


def start_units(params: t.Mapping[str, t.Any], result: dict[str, t.Any], run: Runner, systemctl: str, check: bool,
                reloaded: bool = False) -> None:
    """Enable and start the ``units`` after :func:`apply` installed the files (``result``), reloading
    systemd first when a file changed unless the caller did (``reloaded``); updates ``result``."""
    units = units_of(params)
    written = result["written"]
    if units and written and not check and not reloaded:
        _run(run, [systemctl, "daemon-reload"], "systemctl daemon-reload")
    for unit in units:
        enabled = run([systemctl, "is-enabled", unit])[0] == 0
        active = run([systemctl, "is-active", unit])[0] == 0
        if enabled and active and not written:
            continue
        result["started"].append(unit)
        if not check:
            # systemd was reloaded when a file changed: enable need not reload it again
            _run(run, [systemctl, "enable", "--no-reload", unit], f"systemctl enable {unit}")
            action = "restart" if active else "start"
            _run(run, [systemctl, action, unit], f"systemctl {action} {unit}")
    result["changed"] = bool(written or result["compiled"] or result["started"])
