# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The engine-log and metrics parsers against the format strings of every supported vLLM release.

The collection reads vLLM's own output: the engine log (``_vllm_log``) for the figures the
planner and the boot gate use, and ``/metrics`` (``_vllm_metrics``) for the canary. Both were
written against one release's wording; a new release that rewords a line would otherwise be
found by a rollout whose boot gate sees no figures. So, for every release in
``SUPPORTED_WHEELS``, this module reads the release's Python sources (prepared by
``make vllm-sources``) with :mod:`ast`, finds each logger call and exception message that
prints a line the parser reads, renders it the way vLLM does (the format string evaluated
with representative values, the logger's line prefix taken from the release's
``vllm/logger.py``), and asserts that ``parse_engine_log`` extracts the figures put in.

A line a release no longer prints is declared here with the reason (and, where the
collection models it, checked against ``release_rules``): the test asserts that the line is
really gone, so that neither a silent removal nor a stale declaration goes unnoticed.

For the metrics, the names vLLM registers (``name=`` of the prometheus_client Gauge, Counter
and Histogram calls, and of the wrappers vLLM builds on them) are collected the same way,
and every name ``_vllm_metrics`` reads must be registered, as the kind it is read as, by
every supported release.
"""

from __future__ import annotations

import ast
import builtins
import collections
import functools
import os
import re
import string
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine import _vllm_log, _vllm_metrics
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_log import (
    GIB,
    GIB_ROUNDING_BYTES,
    EngineLog,
    gib_to_bytes,
    parse_engine_log,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_release import (
    SUPPORTED_WHEELS,
    release_rules,
)

REPO = Path(__file__).resolve().parents[2]
SOURCES = Path(os.environ.get("GPUFLEET_CACHE") or REPO / ".cache") / "vllm-sources"

# The logger methods vLLM prints through (its logger adds the *_once variants).
LOG_METHODS = {
    "debug": "DEBUG", "debug_once": "DEBUG", "info": "INFO", "info_once": "INFO",
    "warning": "WARNING", "warning_once": "WARNING", "warn": "WARNING",
    "error": "ERROR", "exception": "ERROR", "critical": "CRITICAL",
}


# --------------------------------------------------------------------------- release sources


def release_root(version: str) -> Path:
    root = SOURCES / version
    if not (root / "vllm" / "__init__.py").is_file():
        pytest.fail(
            f"the Python sources of vLLM {version} are not at {root}: run `make vllm-sources` "
            "(tests/engine/prepare-vllm-sources.sh)"
        )
    return root


class ParsedFile(NamedTuple):
    tree: ast.Module
    parents: dict[ast.AST, ast.AST]


@functools.lru_cache(maxsize=None)
def parse_file(path: Path) -> ParsedFile:
    """One file's syntax tree and the parent of each node (parsed once per session)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    return ParsedFile(tree, parents)


@functools.lru_cache(maxsize=None)
def files_containing(version: str, needles: tuple[str, ...]) -> dict[str, tuple[Path, ...]]:
    """For each needle, the release's files whose text contains it.

    Only a pre-selection so that a few dozen of the release's ~3,500 files are parsed: what a
    file prints is then read from its syntax tree. ``needles`` is every needle of the module
    (one pass over the release reads each file once).
    """
    found: dict[str, list[Path]] = {needle: [] for needle in needles}
    for path in sorted((release_root(version) / "vllm").rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        for needle in needles:
            if needle in text:
                found[needle].append(path)
    return {needle: tuple(paths) for needle, paths in found.items()}


def files_with(version: str, needle: str) -> tuple[Path, ...]:
    return files_containing(version, ALL_NEEDLES)[needle]


def relative(version: str, path: Path) -> str:
    return path.relative_to(release_root(version)).as_posix()


# --------------------------------------------------------------------------- message sites


@dataclass(frozen=True)
class MessageSite:
    """One place in a release's source that prints a message: a logger call or an exception.

    ``steps`` are the assignments that build the message, in order (``msg = f"..."`` then
    ``combined = f"{msg} ..."``); ``message`` is the expression handed to the logger or the
    exception; ``args`` the logger call's %-arguments.
    """

    path: str
    lineno: int
    level: str
    exception: str | None
    steps: tuple[tuple[str, ast.expr], ...]
    message: ast.expr
    args: tuple[ast.expr, ...]

    @property
    def where(self) -> str:
        """The file and line of the format string (and of the call printing it, when elsewhere)."""
        text_lineno = self.steps[0][1].lineno if self.steps else self.message.lineno
        printed = "" if text_lineno == self.lineno else f" (printed at line {self.lineno})"
        return f"{self.path}:{text_lineno}{printed}"


def _callee_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _string_root(node: ast.AST, parents: Mapping[ast.AST, ast.AST]) -> ast.AST:
    """The whole expression a string piece belongs to: f-string, ``+`` concatenation,
    ``.format()``, ``string.Template(...)`` and its ``.substitute()``."""
    while True:
        parent = parents.get(node)
        if parent is None:
            return node
        grandparent = parents.get(parent)
        if (
            isinstance(parent, (ast.JoinedStr, ast.FormattedValue))
            or (isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Add))
            or (isinstance(parent, ast.Call) and _callee_name(parent.func) == "Template" and node in parent.args)
        ):
            node = parent
        elif (
            isinstance(parent, ast.Attribute) and parent.attr in ("format", "substitute")
            and isinstance(grandparent, ast.Call) and grandparent.func is parent
        ):
            node = grandparent
        else:
            return node


def _enclosing_scope(node: ast.AST, parents: Mapping[ast.AST, ast.AST]) -> ast.AST:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node
    return node


def _sites_of(root: ast.AST, steps: tuple[tuple[str, ast.expr], ...], path: str,
              parents: Mapping[ast.AST, ast.AST], depth: int = 0) -> Iterator[MessageSite]:
    """Where the message expression ``root`` ends up: a logger call, a raise, an assert, or a
    variable that one of those (or a larger message) uses later in the same function."""
    parent = parents.get(root)
    if isinstance(parent, ast.Call) and parent.args and parent.args[0] is root:
        method = _callee_name(parent.func)
        if isinstance(parent.func, ast.Attribute) and method in LOG_METHODS:
            yield MessageSite(path, parent.lineno, LOG_METHODS[method], None, steps, root,
                              tuple(parent.args[1:]))
            return
        if isinstance(parents.get(parent), ast.Raise):
            yield MessageSite(path, parent.lineno, "ERROR", _callee_name(parent.func), steps, root, ())
            return
    if isinstance(parent, ast.Assert) and parent.msg is root:
        yield MessageSite(path, parent.lineno, "ERROR", "AssertionError", steps, root, ())
        return
    if (
        isinstance(parent, ast.Assign) and parent.value is root and depth < 4
        and len(parent.targets) == 1 and isinstance(parent.targets[0], ast.Name)
    ):
        name = parent.targets[0].id
        scope = _enclosing_scope(parent, parents)
        # The variable holds this message until the next assignment to it, except one in the
        # other branch of an if/else (``message = plain`` / ``message = logo``, then one call).
        rebinds = [
            node.lineno for node in ast.walk(scope)
            if isinstance(node, ast.Assign) and node.lineno > parent.lineno
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            and not _in_other_branch(parent, node, parents)
        ]
        until = min(rebinds, default=float("inf"))
        for use in ast.walk(scope):
            if (
                isinstance(use, ast.Name) and use.id == name and isinstance(use.ctx, ast.Load)
                and parent.lineno < use.lineno <= until
            ):
                used_in = _string_root(use, parents)
                yield from _sites_of(used_in, (*steps, (name, root)), path, parents, depth + 1)


def _in_other_branch(first: ast.AST, second: ast.AST, parents: Mapping[ast.AST, ast.AST]) -> bool:
    """Whether ``first`` and ``second`` lie in the two branches of one ``if``."""
    def branch_of(node: ast.AST) -> dict[ast.If, str]:
        out: dict[ast.If, str] = {}
        while node in parents:
            parent = parents[node]
            if isinstance(parent, ast.If):
                out[parent] = "body" if node in parent.body else "orelse" if node in parent.orelse else "test"
            node = parent
        return out

    first_branches, second_branches = branch_of(first), branch_of(second)
    return any(
        if_node in second_branches and {side, second_branches[if_node]} == {"body", "orelse"}
        for if_node, side in first_branches.items()
    )


def _constant_text(node: ast.AST) -> str:
    """The literal parts of a message expression, a placeholder mark where a value goes."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_constant_text(v) if isinstance(v, ast.Constant) else "\x00" for v in node.values)
    return "\x00".join(_constant_text(child) for child in ast.iter_child_nodes(node))


def message_sites(version: str, anchor: str) -> list[MessageSite]:
    """Every logger call and exception of the release whose message contains ``anchor``."""
    sites: dict[tuple[str, int, int], MessageSite] = {}
    for path in files_with(version, anchor):
        parsed = parse_file(path)
        for node in ast.walk(parsed.tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and anchor in node.value):
                continue
            root = _string_root(node, parsed.parents)
            for site in _sites_of(root, (), relative(version, path), parsed.parents):
                sites[(site.path, site.lineno, id(site.message))] = site
    return sorted(sites.values(), key=lambda s: (s.path, s.lineno))


# --------------------------------------------------------------------------- rendering


class MissingValue(Exception):
    """The message formats a value this test gives no representative value for."""


class SourceValue:
    """A name or attribute of vLLM's code (``self``, ``self.init_snapshot``...) that is only a
    way to a value: attributes named in the values resolve to them, others to a deeper
    ``SourceValue``; formatting one means the message prints something the test does not know."""

    def __init__(self, path: str, values: Mapping[str, object]) -> None:
        self._path = path
        self._values = values

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._values:
            return self._values[name]
        return SourceValue(f"{self._path}.{name}", self._values)

    def _missing(self, *_: object) -> Any:
        raise MissingValue(self._path)

    __format__ = __str__ = __repr__ = __call__ = __getitem__ = __iter__ = _missing
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _missing


class Scope(Mapping[str, object]):
    """The local names a message is evaluated with: representative values by the name of the
    variable or attribute (``free_memory``, ``max_model_len``), builtins and the release's own
    helpers (``format_gib``) from the globals, anything else a :class:`SourceValue`."""

    def __init__(self, values: Mapping[str, object], helpers: Mapping[str, object]) -> None:
        self._values = dict(values)
        self._helpers = helpers

    def bind(self, name: str, value: object) -> None:
        self._values[name] = value

    def __getitem__(self, name: str) -> object:
        if name in self._values:
            return self._values[name]
        if name in self._helpers or hasattr(builtins, name):
            raise KeyError(name)  # falls through to the globals and the builtins
        return SourceValue(name, self._values)

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def evaluate(node: ast.expr, scope: Scope, helpers: dict[str, object], where: str) -> object:
    code = compile(ast.Expression(body=node), where, "eval")
    # The release's own message expression, evaluated with the test's values.
    return eval(code, helpers, scope)


@functools.lru_cache(maxsize=None)
def release_helpers(version: str) -> dict[str, object]:
    """What a message calls besides builtins: the release's ``format_gib`` (from its source,
    so its rounding is the release's) and ``string.Template`` (the start-up logo)."""
    helpers: dict[str, object] = {"__builtins__": builtins, "Template": string.Template}
    root = release_root(version)
    constants = parse_file(root / "vllm" / "utils" / "mem_constants.py").tree
    for node in constants.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "GiB_bytes" for t in node.targets):
            exec(compile(ast.Module(body=[node], type_ignores=[]), "mem_constants.py", "exec"), helpers)
    mem_utils = parse_file(root / "vllm" / "utils" / "mem_utils.py").tree
    for node in mem_utils.body:
        if isinstance(node, ast.FunctionDef) and node.name == "format_gib":
            exec(compile(ast.Module(body=[node], type_ignores=[]), "mem_utils.py", "exec"), helpers)
    if "format_gib" not in helpers or "GiB_bytes" not in helpers:
        pytest.fail(f"vLLM {version}: format_gib or GiB_bytes not found in vllm/utils/mem_utils.py, mem_constants.py")
    return helpers


@functools.lru_cache(maxsize=None)
def logger_format(version: str) -> str:
    """The release's log line format (``_FORMAT`` of ``vllm/logger.py``), without the optional
    ``VLLM_LOGGING_PREFIX``: ``(%(vllm_process_name)s pid=%(process)d) %(levelname)s ...``."""
    tree = parse_file(release_root(version) / "vllm" / "logger.py").tree
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_FORMAT" for t in node.targets):
            scope = Scope({"VLLM_LOGGING_PREFIX": ""}, {})
            value = evaluate(node.value, scope, {"__builtins__": builtins}, f"vLLM {version} vllm/logger.py")
            assert isinstance(value, str)
            return value
    pytest.fail(f"vLLM {version}: no _FORMAT in vllm/logger.py; the log line prefix cannot be rendered")


def log_lines(version: str, message: str, proc: str, level: str, fileinfo: str, lineno: int) -> str:
    """``message`` as vLLM's logger prints it: every line prefixed (its NewLineFormatter
    repeats the prefix after each newline, with ``\\r\\n``)."""
    record = {"vllm_process_name": proc, "process": 4242, "levelname": level, "asctime": "11-29 21:05:38",
              "fileinfo": fileinfo, "lineno": lineno}
    prefix = logger_format(version) % {**record, "message": ""}
    return prefix + message.replace("\n", "\r\n" + prefix)


def render(version: str, site: MessageSite, values: Mapping[str, object], proc: str) -> list[str]:
    """The text the engine log holds for ``site``: a logger call's line(s); for an exception the
    last line of the traceback, as the failing process logs it and as it ends stderr."""
    helpers = release_helpers(version)
    scope = Scope(values, helpers)
    where = f"vLLM {version} {site.where}"
    for name, expression in site.steps:
        scope.bind(name, evaluate(expression, scope, helpers, where))
    text = str(evaluate(site.message, scope, helpers, where))
    if site.args:  # logging applies %-formatting only when there are arguments
        text = text % tuple(evaluate(arg, scope, helpers, where) for arg in site.args)
    fileinfo = site.path.rsplit("/", 1)[-1]
    if site.exception is None:
        return [log_lines(version, text, proc, site.level, fileinfo, site.lineno)]
    last = f"{site.exception}: {text}"
    return [log_lines(version, last, proc, "ERROR", "core.py", 1000), last]


# --------------------------------------------------------------------------- expected figures


class Gib(NamedTuple):
    """A figure printed in GiB with two decimals: the parser's bytes are within rounding."""

    text: str


def gib(value: float) -> int:
    """Bytes that vLLM's format_gib prints as ``value`` (two decimals)."""
    return round(value * int(GIB))


def figure(log: EngineLog, path: str) -> object:
    """``ranks.1.initial_free_bytes`` -> ``log.ranks[1].initial_free_bytes``;
    ``errors.kinds`` -> ``log.error_kinds()``."""
    if path == "errors.kinds":
        return log.error_kinds()
    value: object = log
    for part in path.split("."):
        if isinstance(value, Mapping):
            value = value.get(int(part) if part.isdigit() else part)
        elif isinstance(value, list):
            value = value[int(part)] if int(part) < len(value) else None
        else:
            value = getattr(value, part, None)
    return value


def agrees(actual: object, expected: object) -> bool:
    if isinstance(expected, Gib):
        return isinstance(actual, int) and abs(actual - gib_to_bytes(expected.text)) <= GIB_ROUNDING_BYTES
    if isinstance(expected, float) and isinstance(actual, float):
        return abs(actual - expected) <= 1e-9 * max(1.0, abs(expected))
    return actual == expected


# --------------------------------------------------------------------------- the lines the parser reads


@dataclass(frozen=True)
class LineSpec:
    """A line the parser reads, how to find it in a release's source and what it must yield.

    ``anchor`` is literal text of the message (contiguous in the source) that picks out its
    logger calls and exceptions; ``values`` the representative value of each variable or
    attribute the message formats (by its name in vLLM's code); ``expect(message)`` the
    figures ``parse_engine_log`` must return, by path into :class:`EngineLog` (a function of
    the rendered message where variants of one message print different figures).
    ``emitted(version)`` is False for a release that no longer prints the line; ``gone_why``
    says why and what the collection does instead. ``recognised`` is False for the lines that
    alone do not make a text vLLM's (``LineRule.recognised``).
    """

    name: str
    patterns: tuple[re.Pattern[str], ...]
    anchor: str
    values: Mapping[str, object]
    expect: Callable[[str], Mapping[str, object]]
    proc: str = "Worker_TP0"
    emitted: Callable[[str], bool] = lambda version: True
    gone_why: str = ""
    recognised: bool = True


def fixed(expected: Mapping[str, object]) -> Callable[[str], Mapping[str, object]]:
    return lambda message: expected


def release_series(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


# Representative figures (bytes vLLM prints in GiB are chosen to print exactly these).
FREE, TOTAL, UTIL, REQUESTED = 78.68, 79.19, 0.9, 71.27
CONSUMED, ACTIVATION, GRAPHS, CURRENT_KV = 8.12, 1.23, 0.48, 61.29
FIT, FULL = 65814485009, 73769838184  # the two exact `--kv-cache-memory=` suggestions

LINE_SPECS: tuple[LineSpec, ...] = (
    LineSpec(
        # The profiled boot: the figures of the capacity model and the two suggestions.
        # Printed by Worker_TP1: the prefix must map it to rank 1.
        name="profiled", patterns=(_vllm_log._PROFILED_HEAD, _vllm_log._SUGGESTION),
        anchor="Desired GPU memory utilization is", proc="Worker_TP1",
        values={
            "free_memory": gib(FREE), "total_memory": gib(TOTAL),
            "gpu_memory_utilization": UTIL, "resolved_gpu_memory_utilization": UTIL,
            "requested_memory": gib(REQUESTED), "total_consumed": gib(CONSUMED),
            "peak_activation_memory": gib(ACTIVATION), "cuda_graph_memory_bytes": gib(GRAPHS),
            "kv_cache_memory_bytes_to_requested_limit": FIT, "kv_cache_memory_bytes_to_gpu_limit": FULL,
            "available_kv_cache_memory_bytes": gib(CURRENT_KV),
        },
        expect=fixed({
            "ranks.1.profiled": True, "ranks.1.initial_free_bytes": Gib(str(FREE)),
            "ranks.1.total_bytes": Gib(str(TOTAL)), "ranks.1.gpu_memory_utilization": UTIL,
            "ranks.1.requested_bytes": Gib(str(REQUESTED)), "ranks.1.consumed_bytes": Gib(str(CONSUMED)),
            "ranks.1.activation_bytes": Gib(str(ACTIVATION)), "ranks.1.cuda_graph_bytes": Gib(str(GRAPHS)),
            "ranks.1.suggested_kv_bytes_fit": FIT, "ranks.1.suggested_kv_bytes_full": FULL,
            "ranks.1.current_kv_bytes": Gib(str(CURRENT_KV)), "suggestion_problems": [],
        }),
    ),
    LineSpec(
        name="manual", patterns=(_vllm_log._MANUAL,), anchor="KV Cache as specified by kv_cache_memory_bytes",
        values={"free_memory": gib(77.9), "kv_cache_memory_bytes": 60_000_000_000},
        expect=fixed({"ranks.0.manual": True, "ranks.0.initial_free_bytes": Gib("77.9"),
                      "ranks.0.reserved_kv_bytes": Gib("55.88")}),
    ),
    LineSpec(
        name="cpu-explicit", patterns=(_vllm_log._CPU_SET,), anchor="Explicitly set (", proc="Worker",
        values={"kv_cache_size": 100_000_000, "total_memory": gib(9.59), "numa_node": 0},
        expect=fixed({"ranks.0.cpu_kv_mode": "explicit", "ranks.0.cpu_kv_bytes": Gib("0.09"),
                      "ranks.0.total_bytes": Gib("9.59")}),
    ),
    LineSpec(
        name="cpu-auto", patterns=(_vllm_log._CPU_SET,), anchor="Auto set (", proc="Worker",
        values={"kv_cache_size": gib(2.12), "total_memory": gib(9.59), "numa_node": 1,
                "requested_cpu_memory": gib(2.88), "consumed_memory": gib(0.76)},
        expect=fixed({"ranks.0.cpu_kv_mode": "auto", "ranks.0.cpu_kv_bytes": Gib("2.12"),
                      "ranks.0.total_bytes": Gib("9.59"), "ranks.0.requested_bytes": Gib("2.88"),
                      "ranks.0.consumed_bytes": Gib("0.76")}),
    ),
    LineSpec(
        name="available-kv", patterns=(_vllm_log._AVAILABLE_KV,), anchor="Available KV cache memory: ",
        values={"available_kv_cache_memory_bytes": gib(61.29)},
        expect=fixed({"ranks.0.available_kv_bytes": Gib("61.29")}),
    ),
    LineSpec(
        name="capacity", patterns=(_vllm_log._CAPACITY_ANY,), anchor="KV cache size: ", proc="EngineCore",
        values={"pools": "GPU", "num_tokens": 1_002_928, "max_model_len": 8192, "max_concurrency": 122.4257},
        expect=fixed({"capacity.device": "GPU", "capacity.tokens": 1_002_928, "capacity.max_model_len": 8192,
                      "capacity.max_concurrency": 122.43}),
    ),
    LineSpec(
        name="model-load", patterns=(_vllm_log._MODEL_LOAD,), anchor="Model loading took",
        values={"consumed_memory": gib(7.51), "model_memory_usage": gib(7.51),
                "time_after_load": 40.0, "time_before_load": 8.1225},
        expect=fixed({"timings.model_load_bytes": Gib("7.51"), "timings.model_load_seconds": 31.8775}),
    ),
    LineSpec(
        name="weights-load", patterns=(_vllm_log._WEIGHTS_LOAD,), anchor="Loading weights took",
        values={"counter_after_loading_weights": 30.5, "counter_before_loading_weights": 2.25},
        expect=fixed({"timings.weights_load_seconds": 28.25}), recognised=False,
    ),
    LineSpec(
        # Three variants: without compilation, with it, with it split by model part (the figure
        # after "compilation:" is then the sum of both parts).
        name="init-engine", patterns=(_vllm_log._INIT_ENGINE,), anchor="init engine (profile, create kv cache, warmup model) took",
        proc="EngineCore",
        values={"elapsed": 42.17, "compile_time": 10.0, "encoder_compile_time": 1.05},
        expect=lambda message: {
            "timings.init_engine_seconds": 42.17,
            "timings.compilation_seconds": 11.05 if "encoder" in message else 10.0 if "compilation" in message else None,
        },
    ),
    LineSpec(
        name="graph-capture", patterns=(_vllm_log._GRAPH_CAPTURE,), anchor="Graph capturing finished in",
        values={"elapsed_time": 19.2, "cuda_graph_size": gib(0.48)},
        expect=fixed({"timings.graph_capture_seconds": 19.0, "timings.graph_capture_bytes": gib_to_bytes("0.48")}),
    ),
    LineSpec(
        name="block-size", patterns=(_vllm_log._BLOCK_SIZE,), anchor="Setting kv cache block size to", proc="APIServer",
        values={"preferred": 32, "backend_classes": [types.SimpleNamespace(get_name=lambda: "FLASH_ATTN")]},
        expect=fixed({"block_size": 32}), recognised=False,
    ),
    LineSpec(
        name="server", patterns=(_vllm_log._SERVER,), anchor="Starting vLLM server on", proc="APIServer",
        values={"listen_address": "http://0.0.0.0:18000"},
        expect=fixed({"server_started": True, "server_url": "http://0.0.0.0:18000"}),
    ),
    LineSpec(
        name="non-default-args", patterns=(_vllm_log._NON_DEFAULT,), anchor="non-default args: ", proc="APIServer",
        values={"redact_sensitive_args": lambda args: args,
                "non_default_args": {"model": "/srv/models/m", "max_model_len": 8192, "kv_cache_memory_bytes": 60_000_000_000}},
        expect=fixed({"non_default_args": {"model": "/srv/models/m", "max_model_len": 8192,
                                           "kv_cache_memory_bytes": 60_000_000_000}}),
    ),
    LineSpec(
        # The engine's config line names the version and the parallel sizes (rank mapping).
        name="engine-config", patterns=(_vllm_log._VERSION, _vllm_log._TP, _vllm_log._PP),
        anchor="Initializing a V1 LLM engine", proc="EngineCore",
        values={"VLLM_VERSION": "9.8.7", "vllm_config": "model='/srv/models/m', tensor_parallel_size=2, "
                                                        "pipeline_parallel_size=3, data_parallel_size=1"},
        expect=fixed({"version": "9.8.7", "tensor_parallel_size": 2, "pipeline_parallel_size": 3}),
    ),
    LineSpec(
        # The API server's start-up line: the logo (here monochrome, as journald and files
        # get it; the parser drops colours) ...
        name="server-version-logo", patterns=(_vllm_log._VERSION,), anchor="version ${w}%s", proc="APIServer",
        values={"version": "9.8.7", "model_name": "/srv/models/m", "colors": collections.defaultdict(str)},
        expect=fixed({"version": "9.8.7"}),
    ),
    LineSpec(
        # ... or its plain form (VLLM_DISABLE_LOG_LOGO, or a logger without vLLM's formatter).
        name="server-version-plain", patterns=(_vllm_log._VERSION,), anchor="vLLM server version", proc="APIServer",
        values={"version": "9.8.7", "model_name": "/srv/models/m"},
        expect=fixed({"version": "9.8.7"}),
    ),
    # ------------------------------------------------------------ refusals and failures
    LineSpec(
        name="startup-check-gpu", patterns=(_vllm_log._STARTUP_GPU,), anchor="less than desired GPU memory utilization",
        values={"device_": "cuda:1", "free_memory": gib(60.5), "total_memory": gib(TOTAL),
                "gpu_memory_utilization": UTIL, "requested_memory": gib(REQUESTED)},
        expect=fixed({"errors.kinds": ["startup_memory_check"], "errors.0.details": {
            "free_bytes": gib_to_bytes("60.5"), "total_bytes": gib_to_bytes(str(TOTAL)),
            "gpu_memory_utilization": UTIL, "requested_bytes": gib_to_bytes(str(REQUESTED))}}),
    ),
    LineSpec(
        name="startup-check-cpu", patterns=(_vllm_log._STARTUP_CPU,), anchor="less than desired CPU memory utilization",
        proc="VllmWorker-0",
        values={"numa_node": 0, "available_memory": gib(8.59), "total_memory": gib(10.09),
                "gpu_memory_utilization": 0.92, "requested_cpu_memory": gib(9.28)},
        expect=fixed({"errors.kinds": ["startup_memory_check"], "errors.0.details": {
            "free_bytes": gib_to_bytes("8.59"), "total_bytes": gib_to_bytes("10.09"),
            "gpu_memory_utilization": 0.92, "requested_bytes": gib_to_bytes("9.28")}}),
        emitted=lambda version: release_rules(version).cpu_startup_check,
        gone_why="the CPU build no longer checks the NUMA node's available memory at startup "
                 "(ReleaseRules.cpu_startup_check is False): a too-high utilization fails later, "
                 "as no_cache_memory or request_does_not_fit",
    ),
    LineSpec(
        name="request-does-not-fit", patterns=(_vllm_log._NOT_FIT,), anchor="To serve at least one request with the model",
        proc="EngineCore",
        values={"max_model_len": 32768, "needed_memory": gib(4.0), "available_memory": gib(1.5),
                "estimated_msg": "", "hint": "Try increasing `gpu_memory_utilization`."},
        expect=fixed({"errors.kinds": ["request_does_not_fit"], "errors.0.details": {
            "max_model_len": 32768, "needed_bytes": gib_to_bytes("4.0"), "available_bytes": gib_to_bytes("1.5")}}),
    ),
    LineSpec(
        name="no-cache-memory", patterns=(_vllm_log._ERROR_PATTERNS[3][1],), anchor="No available memory for the cache blocks",
        proc="EngineCore", values={"hint": "Try increasing `gpu_memory_utilization`."},
        expect=fixed({"errors.kinds": ["no_cache_memory"]}),
    ),
    LineSpec(
        name="model-load-oom", patterns=(_vllm_log._ERROR_PATTERNS[4][1],), anchor="Failed to load model - not enough GPU memory",
        values={"e": "CUDA out of memory. Tried to allocate 2.00 GiB."},
        expect=lambda message: {"errors.kinds": ["model_load_oom"]},
        emitted=lambda version: release_series(version) < (0, 34),
        gone_why="0.34 removed the V1 GPU model runner (vllm/v1/worker/gpu_model_runner.py) that caught a "
                 "load OOM and printed this line; the runner left lets torch.OutOfMemoryError through, "
                 "which the parser reports as cuda_oom",
    ),
    LineSpec(
        name="profiling-error", patterns=(_vllm_log._ERROR_PATTERNS[5][1],), anchor="Error in memory profiling",
        values={"init_free_memory": gib(70.0), "free_gpu_memory": gib(71.0)},
        expect=fixed({"errors.kinds": ["profiling_error"]}),
    ),
    LineSpec(
        name="engine-init-failed", patterns=(_vllm_log._ERROR_PATTERNS[7][1],), anchor="Engine core initialization failed",
        proc="APIServer", values={"finished": {"EngineCore_DP0": 1}, "failed_frontend_procs": {}},
        expect=fixed({"errors.kinds": ["engine_init_failed"]}),
    ),
)

# Patterns no supported release prints, each with the reason the parser keeps it, and text
# whose absence from the release's sources shows it (a release printing it again fails here).
LEGACY_PATTERNS: dict[str, tuple[re.Pattern[str], tuple[str, ...], str]] = {
    "num-gpu-blocks": (_vllm_log._NUM_GPU_BLOCKS, ("# %s blocks", "# GPU blocks"),
                       "the block count line of releases before 0.10; 0.32+ print the KV cache size in tokens"),
}
# Patterns for text vLLM does not write: torch's OOM exception and the generic exception line.
NOT_VLLM_TEXT: dict[str, tuple[re.Pattern[str], str]] = {
    "cuda-oom": (_vllm_log._ERROR_PATTERNS[6][1], "torch's OutOfMemoryError text (checked below: test_torch_oom_is_cuda_oom)"),
    "exception": (_vllm_log._ERROR_PATTERNS[-1][1], "any exception a traceback ends with, whatever raised it"),
}
ALL_NEEDLES: tuple[str, ...] = tuple(sorted(
    {spec.anchor for spec in LINE_SPECS} | {n for _p, needles, _w in LEGACY_PATTERNS.values() for n in needles}
    | {"vllm:"}
))


def check_line(version: str, spec: LineSpec) -> tuple[list[str], int]:
    """Problems with ``spec``'s line in ``version`` (empty: every site parses), and the number
    of sites checked."""
    problems: list[str] = []
    sites = message_sites(version, spec.anchor)
    checked = 0
    for site in sites:
        try:
            texts = render(version, site, spec.values, spec.proc)
        except MissingValue as missing:
            problems.append(
                f"vLLM {version} {site.where}: the {spec.name} message formats `{missing}`, which this test "
                "gives no representative value: the message changed; read the new source and add the value"
            )
            continue
        except (TypeError, ValueError, KeyError) as exc:
            problems.append(f"vLLM {version} {site.where}: the {spec.name} message cannot be rendered ({exc!r})")
            continue
        checked += 1
        for text in texts:
            log = parse_engine_log(text)
            expected = spec.expect(text)
            wrong = {path: figure(log, path) for path, want in expected.items() if not agrees(figure(log, path), want)}
            if wrong or log.recognised != spec.recognised:
                problems.append(
                    f"vLLM {version} {site.where}: the parser does not read the {spec.name} line "
                    f"(patterns {[p.pattern[:60] for p in spec.patterns]}).\n  line: {text!r}\n"
                    f"  expected: { {p: expected[p] for p in wrong} }\n  parsed:   {wrong}"
                    + ("" if log.recognised == spec.recognised else f"\n  recognised as vLLM output: {log.recognised}")
                )
    return problems, checked


# --------------------------------------------------------------------------- tests: engine log


@pytest.mark.parametrize("version", SUPPORTED_WHEELS)
@pytest.mark.parametrize("spec", LINE_SPECS, ids=lambda spec: spec.name)
def test_release_prints_a_line_the_parser_reads(version: str, spec: LineSpec) -> None:
    release_root(version)
    problems, checked = check_line(version, spec)
    assert not problems, "\n".join(problems)
    if spec.emitted(version):
        assert checked, (
            f"vLLM {version} prints no {spec.name} line: no logger call or exception with {spec.anchor!r} "
            f"in its sources. If the release removed it, declare it in LineSpec.emitted with the reason "
            "(and what the collection does instead); if it reworded it, update the anchor, the parser and "
            "its unit tests"
        )
    else:
        assert not checked, f"{spec.name}: declared gone from vLLM {version} ({spec.gone_why}), but printed again"


def test_the_cpu_startup_check_is_gone_from_0_33() -> None:
    """The collection knows which releases run the CPU build's startup check: exactly those
    whose sources print it."""
    spec = next(s for s in LINE_SPECS if s.name == "startup-check-cpu")
    for version in SUPPORTED_WHEELS:
        release_root(version)
        printed = bool(message_sites(version, spec.anchor))
        assert printed == release_rules(version).cpu_startup_check, (
            f"vLLM {version}: the sources {'print' if printed else 'do not print'} the CPU startup check, "
            f"but ReleaseRules.cpu_startup_check is {release_rules(version).cpu_startup_check}"
        )
        assert printed == (release_series(version) < (0, 33)), version


def test_torch_oom_is_cuda_oom() -> None:
    """Where vLLM no longer prints its own load-OOM line (0.34), the OOM surfaces as torch's
    exception; its wording is torch's, the parser must report it as cuda_oom."""
    for text in (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
        "of 79.19 GiB of which 1.12 GiB is free.",
        "(Worker_TP0 pid=4242) ERROR 11-29 21:05:38 [core.py:1000] torch.cuda.OutOfMemoryError: "
        "CUDA out of memory. Tried to allocate 2.00 GiB.",
    ):
        assert parse_engine_log(text).error_kinds() == ["cuda_oom"], text


@pytest.mark.parametrize("version", SUPPORTED_WHEELS)
def test_legacy_lines_are_not_printed(version: str) -> None:
    release_root(version)
    for name, (_pattern, needles, why) in LEGACY_PATTERNS.items():
        for needle in needles:
            found = [site.where for site in message_sites(version, needle)]
            assert not found, f"vLLM {version} prints the legacy {name} line again ({why}): {needle!r} at {found}"


def test_every_parser_pattern_is_checked() -> None:
    """A new rule in the parser needs a line here (or a declared reason it has none)."""
    checked = {id(p) for spec in LINE_SPECS for p in spec.patterns}
    checked |= {id(p) for p, _n, _w in LEGACY_PATTERNS.values()} | {id(p) for p, _w in NOT_VLLM_TEXT.values()}
    needed = [rule.pattern for rule in _vllm_log._LINE_RULES] + [p for _kind, p in _vllm_log._ERROR_PATTERNS]
    needed += [_vllm_log._VERSION, _vllm_log._TP, _vllm_log._PP]
    unchecked = [p.pattern for p in needed if id(p) not in checked]
    assert not unchecked, f"parser patterns no release line is checked against: {unchecked}"


# --------------------------------------------------------------------------- metrics


class Registration(NamedTuple):
    kind: str  # gauge | counter | histogram | unknown
    where: str


def _metric_kind(callee: str) -> str:
    lowered = callee.lower()
    for kind in ("gauge", "counter", "histogram"):
        if kind in lowered:
            return kind
    return "unknown"


def _name_values(node: ast.expr, call: ast.Call, parents: Mapping[ast.AST, ast.AST]) -> list[str]:
    """The string(s) a ``name=`` argument holds: a constant, or a variable assigned constants
    in the same function (``name = "vllm:cache_config_info"``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name):
        scope = _enclosing_scope(call, parents)
        return [
            assign.value.value for assign in ast.walk(scope)
            if isinstance(assign, ast.Assign) and isinstance(assign.value, ast.Constant)
            and isinstance(assign.value.value, str)
            and any(isinstance(t, ast.Name) and t.id == node.id for t in assign.targets)
        ]
    return []


@functools.lru_cache(maxsize=None)
def registered_metrics(version: str) -> dict[str, list[Registration]]:
    """Every ``vllm:*`` metric the release registers, by the name its samples carry (a counter
    registered as ``x_total`` is exposed as ``x_total`` like one registered as ``x``:
    prometheus_client strips the suffix and adds it back; the base name is kept here)."""
    found: dict[str, list[Registration]] = collections.defaultdict(list)
    for path in files_with(version, "vllm:"):
        parsed = parse_file(path)
        for call in ast.walk(parsed.tree):
            if not isinstance(call, ast.Call):
                continue
            callee = _callee_name(call.func)
            candidates = [kw.value for kw in call.keywords if kw.arg == "name"]
            if not candidates and call.args and _metric_kind(callee) != "unknown":
                candidates = [call.args[0]]
            for candidate in candidates:
                for name in _name_values(candidate, call, parsed.parents):
                    if not name.startswith("vllm:"):
                        continue
                    kind = _metric_kind(callee)
                    if kind == "counter" and name.endswith("_total"):
                        name = name[: -len("_total")]
                    found[name].append(Registration(kind, f"{relative(version, path)}:{call.lineno}"))
    return dict(found)


# How _vllm_metrics reads each name: counters through _counter (``x_total`` or ``x``),
# histograms through their _bucket/_count/_sum samples, gauges by the name itself.
METRIC_KINDS: dict[str, str] = {
    _vllm_metrics.CACHE_CONFIG: "gauge",
    _vllm_metrics.PREEMPTIONS: "counter",
    _vllm_metrics.REQUEST_SUCCESS: "counter",
    _vllm_metrics.RUNNING: "gauge",
    _vllm_metrics.WAITING: "gauge",
    **dict.fromkeys(_vllm_metrics.KV_USAGE, "gauge"),
    _vllm_metrics.PROMPT_TOKENS: "counter",
    _vllm_metrics.GENERATION_TOKENS: "counter",
    _vllm_metrics.TTFT: "histogram",
    _vllm_metrics.E2E: "histogram",
    **dict.fromkeys(_vllm_metrics.ITL, "histogram"),
}
# The labels of vllm:cache_config_info the parser reads: CacheConfig fields (its
# metrics_info() is the config's __dict__).
CACHE_CONFIG_LABELS = ("num_gpu_blocks", "block_size", "kv_cache_memory_bytes", "kv_cache_size_tokens",
                       "kv_cache_max_concurrency", "gpu_memory_utilization", "cache_dtype")


def metric_names_read() -> list[tuple[str, ...]]:
    """The names _vllm_metrics reads, from its module constants: one tuple of alternatives per
    figure (KV_USAGE accepts the old and the new name)."""
    groups: list[tuple[str, ...]] = []
    for value in vars(_vllm_metrics).values():
        if isinstance(value, str) and value.startswith("vllm:"):
            groups.append((value,))
        elif isinstance(value, tuple) and value and all(isinstance(v, str) and v.startswith("vllm:") for v in value):
            groups.append(value)
    return groups


def test_every_metric_read_has_a_kind() -> None:
    read = {name for group in metric_names_read() for name in group}
    assert read == set(METRIC_KINDS), f"names _vllm_metrics reads without a kind here: {read ^ set(METRIC_KINDS)}"


@pytest.mark.parametrize("version", SUPPORTED_WHEELS)
def test_release_registers_every_metric_read(version: str) -> None:
    release_root(version)
    registered = registered_metrics(version)
    assert len(registered) > 20, f"vLLM {version}: only {sorted(registered)} found; the extraction is broken"
    problems = []
    for group in metric_names_read():
        present = [name for name in group if name in registered]
        if not present:
            problems.append(f"vLLM {version} registers none of {group}: renamed? make _vllm_metrics accept the new name")
            continue
        for name in present:
            kinds = {reg.kind for reg in registered[name]}
            if METRIC_KINDS[name] not in kinds:
                where = [reg.where for reg in registered[name]]
                problems.append(f"vLLM {version} registers {name} as {sorted(kinds)} ({where}), the parser reads a {METRIC_KINDS[name]}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("version", SUPPORTED_WHEELS)
def test_cache_config_labels_are_config_fields(version: str) -> None:
    path = release_root(version) / "vllm" / "config" / "cache.py"
    tree = parse_file(path).tree
    config = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheConfig"), None)
    assert config is not None, f"vLLM {version}: no class CacheConfig in vllm/config/cache.py"
    fields = {n.target.id for n in config.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    missing = [label for label in CACHE_CONFIG_LABELS if label not in fields]
    assert not missing, f"vLLM {version} vllm/config/cache.py: CacheConfig has no field {missing} (cache_config_info labels)"


@pytest.mark.parametrize("version", SUPPORTED_WHEELS)
def test_kv_usage_renamed_metric_parses(version: str) -> None:
    """Whichever KV usage name a release registers, parse_metrics reads it."""
    release_root(version)
    name = next(n for n in _vllm_metrics.KV_USAGE if n in registered_metrics(version))
    scrape = f'{name}{{engine="0",model_name="m"}} 0.25\n{name}{{engine="1",model_name="m"}} 0.5\n'
    assert _vllm_metrics.parse_metrics(scrape, use_prometheus_client=False).kv_cache_usage == 0.5
