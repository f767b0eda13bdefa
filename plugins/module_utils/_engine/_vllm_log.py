# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Parser for vLLM engine logs (``vllm serve`` stdout/stderr or its journal).

Plain Python, no Ansible import. The parser reads the lines vLLM prints while
it loads the model, sizes the KV cache and starts serving, per GPU rank, in
the GPU wordings of several releases and in the CPU build's wording.

Precision: vLLM prints most memory figures in GiB with two decimals. Every
``*_bytes`` field derived from such a figure is **approximate** (the true value
lies within ``GIB_ROUNDING_BYTES`` of it). The profiled suggestions
``suggested_kv_bytes_fit`` (A) and ``suggested_kv_bytes_full`` (B) are printed
as exact integers and are kept exact; so is ``current_kv_bytes`` when a release
prints it in bytes.

Rank mapping (from the process prefix ``(<proc> pid=N)``):

- ``Worker_TP<t>`` -> ``t``; ``Worker_PP<p>_TP<t>`` -> ``p * tp_size + t``,
  where ``tp_size`` is the engine's ``tensor_parallel_size`` (from the
  argument, else from the engine config line, else the highest TP index seen
  in the log plus one); ``Worker_DP<d>_...`` and ``EngineCore_DP<d>`` add
  ``d * tp_size * pp_size``;
- ``VllmWorker rank=<r>`` (older releases) -> ``r``; ``VllmWorker-<n>`` -> ``n``;
- ``EngineCore``, ``Worker``, ``APIServer`` and unprefixed lines -> 0.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, TypeVar

GIB = 1 << 30
#: Half a unit of the last printed digit of a GiB figure (0.005 GiB), rounded up to a whole
#: byte: a logged figure is within this many bytes of the exact one. The one definition; the
#: planner's floors and the boot check's comparisons use it too.
GIB_ROUNDING_BYTES = -(-GIB // 200)

__all__ = [
    "GIB",
    "GIB_ROUNDING_BYTES",
    "Capacity",
    "EngineError",
    "EngineLog",
    "LogParser",
    "RankFigures",
    "SuggestionProblem",
    "Timings",
    "gib_to_bytes",
    "member_rank_offset",
    "parse_engine_log",
]

ERROR_KINDS = (
    "startup_memory_check",
    "no_cache_memory",
    "request_does_not_fit",
    "model_load_oom",
    "profiling_error",
    "cuda_oom",
    "engine_init_failed",
)
# Not a failure by itself (a shutdown after SIGTERM prints EngineDeadError): the other
# exceptions tracebacks end with, kept as EngineLog.exceptions for a failed boot's root cause.
EXCEPTION_KIND = "exception"


def member_rank_offset(logged: Iterable[Any], first_rank: int, ranks: int) -> int:
    """What to add to the rank numbers a gang member's log gives to number them in the whole instance.

    Tensor and pipeline parallelism over nodes name a worker by its rank in the instance (``Worker_TP9`` on the
    second of two hosts with 8 GPUs: rank 9); so do data-parallel workers named with their engine
    (``Worker_DP1_TP0``). The CPU build's data-parallel engine names its one worker ``Worker`` on every member
    (rank 0 there): when every rank the log gives lies within the member's ``ranks`` (its GPUs) and the member's
    ``first_rank`` is above 0, the log numbers them within the member, and ``first_rank`` is added."""
    numbers = [r for r in logged if isinstance(r, int) and not isinstance(r, bool)]
    return first_rank if first_rank > 0 and numbers and min(numbers) >= 0 and max(numbers) < ranks else 0


def gib_to_bytes(value: str | float) -> int:
    """Convert a GiB figure as printed by vLLM into bytes (rounded to an int)."""
    return round(float(value) * GIB)


@dataclass
class RankFigures:
    """Memory figures one rank printed. ``*_bytes`` from GiB text are approximate.

    GPU profiled boot: ``initial_free_bytes`` (F), ``total_bytes`` (T),
    ``gpu_memory_utilization``, ``requested_bytes`` (R = T * util),
    ``consumed_bytes`` (weights + non-torch; older wording: ``weights_bytes``
    and ``non_torch_bytes``, summed into ``consumed_bytes``),
    ``activation_bytes``, ``cuda_graph_bytes``, ``suggested_kv_bytes_fit`` (A,
    exact), ``suggested_kv_bytes_full`` (B, exact), ``current_kv_bytes`` (K).
    GPU manual boot: ``initial_free_bytes`` and ``reserved_kv_bytes``.
    CPU build: ``cpu_kv_mode`` (``explicit`` for ``--kv-cache-memory-bytes``,
    ``auto`` for utilization sizing) with ``cpu_kv_bytes`` and
    ``total_bytes`` (NUMA node memory); auto mode adds ``requested_bytes`` and
    ``consumed_bytes``. A failed startup check fills ``initial_free_bytes``,
    ``total_bytes``, ``gpu_memory_utilization`` and ``requested_bytes``.
    """

    rank: int
    proc: str = ""
    initial_free_bytes: int | None = None
    total_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    requested_bytes: int | None = None
    consumed_bytes: int | None = None
    weights_bytes: int | None = None
    non_torch_bytes: int | None = None
    activation_bytes: int | None = None
    cuda_graph_bytes: int | None = None
    suggested_kv_bytes_fit: int | None = None
    suggested_kv_bytes_full: int | None = None
    current_kv_bytes: int | None = None
    current_kv_bytes_exact: bool = False
    reserved_kv_bytes: int | None = None
    available_kv_bytes: int | None = None
    cpu_kv_mode: str | None = None
    cpu_kv_bytes: int | None = None
    model_load_bytes: int | None = None
    model_load_seconds: float | None = None
    profiled: bool = False
    manual: bool = False


@dataclass
class Capacity:
    """The engine's ``<DEVICE> KV cache size: N tokens`` report."""

    device: str | None = None
    tokens: int | None = None
    max_model_len: int | None = None
    max_concurrency: float | None = None


@dataclass
class Timings:
    """Startup timings (seconds) and the memory the model load took."""

    model_load_bytes: int | None = None
    model_load_seconds: float | None = None
    weights_load_seconds: float | None = None
    init_engine_seconds: float | None = None
    compilation_seconds: float | None = None
    graph_capture_seconds: float | None = None
    graph_capture_bytes: int | None = None


@dataclass
class EngineError:
    """A failure the engine reported. ``details`` holds the figures it printed."""

    kind: str
    message: str
    rank: int
    details: dict[str, float | int] = field(default_factory=dict)


@dataclass
class SuggestionProblem:
    """A profiled suggestion that must not be used, with the reason."""

    rank: int
    kind: str  # fit_not_positive | full_not_positive | fit_above_full
    message: str


@dataclass
class EngineLog:
    """Everything recognised in one engine log."""

    ranks: dict[int, RankFigures] = field(default_factory=dict)
    capacity: Capacity | None = None
    timings: Timings = field(default_factory=Timings)
    errors: list[EngineError] = field(default_factory=list)
    exceptions: list[EngineError] = field(default_factory=list)
    suggestion_problems: list[SuggestionProblem] = field(default_factory=list)
    recognised: bool = False
    version: str | None = None
    non_default_args: dict[str, object] = field(default_factory=dict)
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    server_started: bool = False
    server_url: str | None = None

    @property
    def failed(self) -> bool:
        return bool(self.errors)

    def error_kinds(self) -> list[str]:
        return [e.kind for e in self.errors]


# --------------------------------------------------------------------------- regexes

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_PREFIX = re.compile(
    r"\((?P<proc>[A-Za-z][\w.-]*)(?: rank=(?P<rank>\d+))? pid=(?P<pid>\d+)\)\s+"
    r"(?:(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+"
    r"(?:\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+)?(?:\[[^\]]*\]\s*)?)?"
)
_NUM = r"-?\d+(?:\.\d+)?"

_PROFILED_HEAD = re.compile(
    rf"Free memory on device(?: \S+)? \(({_NUM})/({_NUM}) GiB\) on startup\. "
    rf"Desired GPU memory utilization is \(({_NUM}), ({_NUM}) GiB\)"
)
_CONSUMED = re.compile(rf"({_NUM}) GiB for consumed memory")
_WEIGHTS = re.compile(rf"({_NUM}) GiB for weights?\b")
_NON_TORCH = re.compile(rf"({_NUM}) GiB for non-torch memory")
_ACTIVATION = re.compile(rf"({_NUM}) GiB for peak activation")
_GRAPH = re.compile(rf"({_NUM}) GiB for (?:CUDAGraph|CUDA graph|\w+ graph) memory")
_SUGGESTION = re.compile(r"`--kv-cache-memory(?:-bytes)?=(-?\d+)`")
_CURRENT = re.compile(
    rf"Current (?:kv|KV) cache memory(?: in use is|:) ({_NUM}) (GiB|bytes)"
)
_MANUAL = re.compile(
    rf"Initial free memory ({_NUM}) GiB, reserved ({_NUM}) GiB memory for KV Cache"
)
_CPU_SET = re.compile(
    rf"(Explicitly|Auto) set \(({_NUM})/({_NUM})\) GiB for KV cache on node \d+"
    rf"(?:, with ({_NUM}) GiB requested memory for the worker\. "
    rf"({_NUM}) GiB memory was consumed by non-kv usages)?"
)
_AVAILABLE_KV = re.compile(rf"Available KV cache memory: ({_NUM}) GiB")
_CAPACITY_SIZE = re.compile(r"\b([A-Z]{2,5}) KV cache size: ([\d,]+) tokens")
_CAPACITY_CONC = re.compile(
    r"Maximum concurrency for ([\d,]+) tokens per request: (" + _NUM + r")x"
)
_MODEL_LOAD = re.compile(
    rf"Model loading took ({_NUM}) GiB(?: memory)? and ({_NUM}) seconds"
)
_WEIGHTS_LOAD = re.compile(rf"Loading weights took ({_NUM}) seconds")
# The compilation figure is followed by ")" or, when an encoder was compiled too, by its
# split: "(compilation: 11.05 s — language_model: 10.00 s, encoder: 1.05 s)".
_INIT_ENGINE = re.compile(
    rf"init engine \(profile, create kv cache, warmup model\) took ({_NUM}) "
    rf"(?:s|secs|seconds)(?: \(compilation: ({_NUM}) s\b)?"
)
_GRAPH_CAPTURE = re.compile(
    rf"Graph capturing finished in ({_NUM}) secs?, took ({_NUM}) GiB"
)
_BLOCK_SIZE = re.compile(r"Setting kv cache block size to (\d+)")
_NUM_GPU_BLOCKS = re.compile(r"# (?:GPU|CPU|XPU|NPU) blocks: (\d+)")
# The API server's start-up line is the logo's "version X", or without the logo
# (VLLM_DISABLE_LOG_LOGO) "vLLM server version X, serving model M" ("vLLM API server
# version X" in older releases).
_VERSION = re.compile(
    r"(?:Initializing a V\d LLM engine \(v?([\w.+-]+)\)"
    r"|vLLM (?:API )?server version ([\w.+-]+)"
    r"|█\s+version (\d+\.\d+\.\d+[\w.+-]*))"
)
_TP = re.compile(r"\btensor_parallel_size=(\d+)")
_PP = re.compile(r"\bpipeline_parallel_size=(\d+)")
_NON_DEFAULT = re.compile(r"non-default args: (\{.*\})\s*$")
_SERVER = re.compile(r"Starting vLLM (?:API )?server on (\S+)")

_STARTUP_GPU = re.compile(
    rf"Free memory on device(?: (\S+))? \(({_NUM})/({_NUM}) GiB\) on startup is less "
    rf"than desired GPU memory utilization \(({_NUM}), ({_NUM}) GiB\)"
)
_STARTUP_CPU = re.compile(
    rf"Available memory on node (\d+) \(({_NUM})/({_NUM}) GiB\) on startup is less "
    rf"than desired CPU memory utilization \(({_NUM}), ({_NUM}) GiB\)"
)
_NOT_FIT = re.compile(
    rf"To serve at least one request with the model's max seq len \((\d+)\), "
    rf"\(({_NUM}) GiB KV cache is needed, which is larger than the available KV "
    rf"cache memory \(({_NUM}) GiB\)"
)
_ERROR_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("startup_memory_check", _STARTUP_GPU),
    ("startup_memory_check", _STARTUP_CPU),
    ("request_does_not_fit", _NOT_FIT),
    ("no_cache_memory", re.compile(r"No available memory for the cache blocks")),
    ("model_load_oom", re.compile(r"Failed to load model - not enough GPU memory")),
    ("profiling_error", re.compile(r"Error in memory profiling")),
    (
        "cuda_oom",
        re.compile(r"(?:torch\.(?:cuda\.)?OutOfMemoryError|CUDA out of memory)"),
    ),
    ("engine_init_failed", re.compile(r"Engine core initialization failed")),
    # Any other exception a traceback ends with (a worker's FileNotFoundError, an
    # ImportError...): the root cause vLLM's "See root cause above" points at.
    (EXCEPTION_KIND, re.compile(r"^\s*((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)): \S")),
)
_PROC_TP = re.compile(r"(?:^|_)TP(\d+)")
_PROC_PP = re.compile(r"(?:^|_)PP(\d+)")
_PROC_DP = re.compile(r"(?:^|_)DP(\d+)")
_PROC_N = re.compile(r"^VllmWorker-(\d+)$")
_N = TypeVar("_N", int, float)


def _int_commas(text: str) -> int:
    return int(text.replace(",", ""))


# --------------------------------------------------------------------------- parser


class LogParser:
    """Streaming parser: ``feed(line)`` as lines arrive, ``result()`` at any time.

    ``tp_size`` overrides the tensor-parallel size used to map
    ``Worker_PP<p>_TP<t>`` prefixes to ranks.
    """

    def __init__(self, tp_size: int | None = None) -> None:
        self._tp_override = tp_size
        # per (process, explicit rank): RankFigures fields (bytes, utilization, flags, the CPU KV mode)
        self._procs: dict[tuple[str, int | None], dict[str, int | float | str]] = {}
        # (error, process key, sentence) in order of appearance
        self._errors: list[tuple[EngineError, tuple[str, int | None], str]] = []
        self._seen_errors: set[tuple[str, str, str, int | None]] = set()
        self._log = EngineLog()
        self._capacity = Capacity()
        self._max_tp_index = -1
        self._max_pp_index = -1

    # ------------------------------------------------------------------ input
    def feed_text(self, text: str) -> LogParser:
        for line in text.splitlines():
            self.feed(line)
        return self

    def feed(self, line: str) -> None:
        line = _ANSI.sub("", line).rstrip("\r\n")
        if not line.strip():
            return
        m = _PREFIX.search(line)
        if m:
            proc = m.group("proc")
            explicit = int(m.group("rank")) if m.group("rank") is not None else None
            msg = line[m.end():]
        else:
            proc, explicit, msg = "", None, line
        key = (proc, explicit)
        tp = _PROC_TP.search(proc)
        if tp:
            self._max_tp_index = max(self._max_tp_index, int(tp.group(1)))
        pp = _PROC_PP.search(proc)
        if pp:
            self._max_pp_index = max(self._max_pp_index, int(pp.group(1)))
        self._parse_message(key, msg)

    # ------------------------------------------------------------------ helpers
    def _figs(self, key: tuple[str, int | None]) -> dict[str, int | float | str]:
        return self._procs.setdefault(key, {})

    def _hit(self) -> None:
        self._log.recognised = True

    def _parse_message(self, key: tuple[str, int | None], msg: str) -> None:
        # Errors first: the startup-check failure shares its start with the profiled line.
        for kind, pattern in _ERROR_PATTERNS:
            em = pattern.search(msg)
            if em:
                self._add_error(key, kind, msg, em)
                return
        # The first rule whose pattern matches reads the line; a line no rule reads may
        # still name the version and the parallel sizes (the engine's config line).
        for rule in _LINE_RULES:
            m = rule.pattern.search(msg)
            if m:
                if rule.recognised:
                    self._hit()
                rule.read(self, key, msg, m)
                return
        self._read_config(msg)

    # ------------------------------------------------------------------ line readers
    def _read_profiled(self, key: tuple[str, int | None], msg: str, m: re.Match[str]) -> None:
        f = self._figs(key)
        f["profiled"] = True
        f["initial_free_bytes"] = gib_to_bytes(m.group(1))
        f["total_bytes"] = gib_to_bytes(m.group(2))
        f["gpu_memory_utilization"] = float(m.group(3))
        f["requested_bytes"] = gib_to_bytes(m.group(4))
        weights = _WEIGHTS.search(msg)
        non_torch = _NON_TORCH.search(msg)
        consumed = _CONSUMED.search(msg)
        if weights:
            f["weights_bytes"] = gib_to_bytes(weights.group(1))
        if non_torch:
            f["non_torch_bytes"] = gib_to_bytes(non_torch.group(1))
        if consumed:
            f["consumed_bytes"] = gib_to_bytes(consumed.group(1))
        elif weights or non_torch:
            f["consumed_bytes"] = int(f.get("weights_bytes") or 0) + int(f.get("non_torch_bytes") or 0)
        for name, rx in (("activation_bytes", _ACTIVATION), ("cuda_graph_bytes", _GRAPH)):
            vm = rx.search(msg)
            if vm:
                f[name] = gib_to_bytes(vm.group(1))
        sugg = _SUGGESTION.findall(msg)
        if len(sugg) >= 1:
            f["suggested_kv_bytes_fit"] = int(sugg[0])
        if len(sugg) >= 2:
            f["suggested_kv_bytes_full"] = int(sugg[1])
        cur = _CURRENT.search(msg)
        if cur:
            if cur.group(2) == "bytes":
                f["current_kv_bytes"] = int(float(cur.group(1)))
                f["current_kv_bytes_exact"] = True
            else:
                f["current_kv_bytes"] = gib_to_bytes(cur.group(1))

    def _read_manual(self, key: tuple[str, int | None], msg: str, m: re.Match[str]) -> None:
        f = self._figs(key)
        f["manual"] = True
        f["initial_free_bytes"] = gib_to_bytes(m.group(1))
        f["reserved_kv_bytes"] = gib_to_bytes(m.group(2))

    def _read_cpu_set(self, key: tuple[str, int | None], msg: str, m: re.Match[str]) -> None:
        f = self._figs(key)
        f["cpu_kv_mode"] = "explicit" if m.group(1) == "Explicitly" else "auto"
        f["manual"] = m.group(1) == "Explicitly"
        f["cpu_kv_bytes"] = gib_to_bytes(m.group(2))
        f["total_bytes"] = gib_to_bytes(m.group(3))
        if m.group(4) is not None:
            f["requested_bytes"] = gib_to_bytes(m.group(4))
            f["consumed_bytes"] = gib_to_bytes(m.group(5))

    def _read_available_kv(self, key: tuple[str, int | None], msg: str, m: re.Match[str]) -> None:
        self._figs(key)["available_kv_bytes"] = gib_to_bytes(m.group(1))

    def _read_capacity(self, key: tuple[str, int | None], msg: str, m: re.Match[str]) -> None:
        # one line holds the size and the concurrency; the first line of each counts
        size = _CAPACITY_SIZE.search(msg)
        if size and self._capacity.tokens is None:
            self._capacity.device = size.group(1)
            self._capacity.tokens = _int_commas(size.group(2))
        conc = _CAPACITY_CONC.search(msg)
        if conc and self._capacity.max_model_len is None:
            self._capacity.max_model_len = _int_commas(conc.group(1))
            self._capacity.max_concurrency = float(conc.group(2))

    def _read_model_load(self, key: tuple[str, int | None], msg: str, m: re.Match[str]) -> None:
        f = self._figs(key)
        b, s = gib_to_bytes(m.group(1)), float(m.group(2))
        f["model_load_bytes"] = b
        f["model_load_seconds"] = s
        t = self._log.timings
        t.model_load_bytes = _larger(t.model_load_bytes, b)
        t.model_load_seconds = _larger(t.model_load_seconds, s)

    def _read_weights_load(self, key: tuple[str, int | None], msg: str, m: re.Match[str]) -> None:
        t = self._log.timings
        t.weights_load_seconds = _larger(t.weights_load_seconds, float(m.group(1)))

    def _read_init_engine(self, key: tuple[str, int | None], msg: str, m: re.Match[str]) -> None:
        self._log.timings.init_engine_seconds = float(m.group(1))
        if m.group(2) is not None:
            self._log.timings.compilation_seconds = float(m.group(2))

    def _read_graph_capture(self, key: tuple[str, int | None], msg: str, m: re.Match[str]) -> None:
        t = self._log.timings
        t.graph_capture_seconds = _larger(t.graph_capture_seconds, float(m.group(1)))
        t.graph_capture_bytes = _larger(t.graph_capture_bytes, gib_to_bytes(m.group(2)))

    def _read_block_size(self, key: tuple[str, int | None], msg: str, m: re.Match[str]) -> None:
        self._log.block_size = int(m.group(1))

    def _read_num_blocks(self, key: tuple[str, int | None], msg: str, m: re.Match[str]) -> None:
        self._log.num_gpu_blocks = int(m.group(1))

    def _read_server(self, key: tuple[str, int | None], msg: str, m: re.Match[str]) -> None:
        self._log.server_started = True
        self._log.server_url = m.group(1)

    def _read_non_default(self, key: tuple[str, int | None], msg: str, m: re.Match[str]) -> None:
        try:
            value = ast.literal_eval(m.group(1))
        except (ValueError, SyntaxError):
            value = None
        if isinstance(value, dict):
            self._log.non_default_args = {str(k): v for k, v in value.items()}

    def _read_config(self, msg: str) -> None:
        log = self._log
        if "LLM engine" in msg or "version" in msg:
            vm = _VERSION.search(msg)
            if vm and log.version is None:
                self._hit()
                log.version = next(g for g in vm.groups() if g)
        tpm = _TP.search(msg)
        if tpm:
            log.tensor_parallel_size = int(tpm.group(1))
        ppm = _PP.search(msg)
        if ppm:
            log.pipeline_parallel_size = int(ppm.group(1))

    def _add_error(
        self, key: tuple[str, int | None], kind: str, msg: str, m: re.Match[str]
    ) -> None:
        self._hit()
        text = msg.strip()
        # The same exception is often printed by the worker, the engine core
        # and the final traceback: one entry per process here, duplicates
        # across processes are dropped in result() once ranks are known.
        sentence = text[text.find(m.group(0)):]
        dedupe = (kind, sentence, key[0], key[1])
        if dedupe in self._seen_errors:
            return
        self._seen_errors.add(dedupe)
        details: dict[str, float | int] = {}
        if m.re is _STARTUP_GPU or m.re is _STARTUP_CPU:
            details = {
                "free_bytes": gib_to_bytes(m.group(2)),
                "total_bytes": gib_to_bytes(m.group(3)),
                "gpu_memory_utilization": float(m.group(4)),
                "requested_bytes": gib_to_bytes(m.group(5)),
            }
        elif m.re is _NOT_FIT:
            details = {
                "max_model_len": int(m.group(1)),
                "needed_bytes": gib_to_bytes(m.group(2)),
                "available_bytes": gib_to_bytes(m.group(3)),
            }
        self._errors.append(
            (EngineError(kind=kind, message=text, rank=0, details=details), key, sentence)
        )

    # ------------------------------------------------------------------ output
    def _tp_size(self) -> int:
        if self._tp_override:
            return self._tp_override
        if self._log.tensor_parallel_size:
            return self._log.tensor_parallel_size
        return max(1, self._max_tp_index + 1)

    def _pp_size(self) -> int:
        if self._log.pipeline_parallel_size:
            return self._log.pipeline_parallel_size
        return max(1, self._max_pp_index + 1)

    def rank_of(self, proc: str, explicit_rank: int | None = None) -> int:
        """Map a process prefix (``Worker_PP1_TP3``...) to a global rank."""
        if explicit_rank is not None:
            return explicit_rank
        n = _PROC_N.match(proc)
        if n:
            return int(n.group(1))
        tp_size = self._tp_size()
        tp = _PROC_TP.search(proc)
        pp = _PROC_PP.search(proc)
        dp = _PROC_DP.search(proc)
        rank = 0
        if tp:
            rank += int(tp.group(1))
        if pp:
            rank += int(pp.group(1)) * tp_size
        if dp:
            rank += int(dp.group(1)) * tp_size * self._pp_size()
        return rank

    def result(self) -> EngineLog:
        log = self._log
        ranks: dict[int, RankFigures] = {}
        for (proc, explicit), figs in self._procs.items():
            rank = self.rank_of(proc, explicit)
            rf = ranks.get(rank)
            if rf is None:
                rf = ranks[rank] = RankFigures(rank=rank, proc=proc)
            for name, value in figs.items():
                setattr(rf, name, value)
        log.errors = []
        worker_sentences = {
            (err.kind, sentence) for err, key, sentence in self._errors if "Worker" in key[0]
        }
        prefixed_sentences = {(err.kind, sentence) for err, key, sentence in self._errors if key[0]}
        emitted: set[tuple[str, str, int]] = set()
        for err, (proc, explicit), sentence in self._errors:
            ident = (err.kind, sentence)
            if not proc and ident in prefixed_sentences:
                continue  # the traceback repeating a logged error
            if proc and "Worker" not in proc and ident in worker_sentences:
                continue  # the engine core repeating a worker's error
            rank = self.rank_of(proc, explicit)
            if (err.kind, sentence, rank) in emitted:
                continue
            emitted.add((err.kind, sentence, rank))
            log.errors.append(dataclasses.replace(err, rank=rank))
            if err.kind == "startup_memory_check":
                # The failed check still tells what this rank saw at startup.
                rf = ranks.get(rank)
                if rf is None:
                    rf = ranks[rank] = RankFigures(rank=rank, proc=proc)
                for name, detail in (
                    ("initial_free_bytes", "free_bytes"),
                    ("total_bytes", "total_bytes"),
                    ("gpu_memory_utilization", "gpu_memory_utilization"),
                    ("requested_bytes", "requested_bytes"),
                ):
                    if getattr(rf, name) is None:
                        setattr(rf, name, err.details[detail])
        log.exceptions = [e for e in log.errors if e.kind == EXCEPTION_KIND]
        log.errors = [e for e in log.errors if e.kind != EXCEPTION_KIND]
        log.ranks = dict(sorted(ranks.items()))
        log.capacity = self._capacity if self._capacity.tokens is not None or (
            self._capacity.max_concurrency is not None
        ) else None
        log.suggestion_problems = _suggestion_problems(log.ranks)
        return copy.deepcopy(log)


Reader = Callable[[LogParser, "tuple[str, int | None]", str, "re.Match[str]"], None]


@dataclass(frozen=True)
class LineRule:
    """A line vLLM prints, the reader that takes its figures, and whether it counts as
    recognised engine output (a line that names only a block size or a weights-load time
    is not enough to call a log vLLM's)."""

    pattern: re.Pattern[str]
    read: Reader
    recognised: bool = True


_CAPACITY_ANY = re.compile(f"{_CAPACITY_SIZE.pattern}|{_CAPACITY_CONC.pattern}")

#: In order: the first rule whose pattern matches reads the line.
_LINE_RULES: tuple[LineRule, ...] = (
    LineRule(_PROFILED_HEAD, LogParser._read_profiled),
    LineRule(_MANUAL, LogParser._read_manual),
    LineRule(_CPU_SET, LogParser._read_cpu_set),
    LineRule(_AVAILABLE_KV, LogParser._read_available_kv),
    LineRule(_CAPACITY_ANY, LogParser._read_capacity),
    LineRule(_MODEL_LOAD, LogParser._read_model_load),
    LineRule(_WEIGHTS_LOAD, LogParser._read_weights_load, recognised=False),
    LineRule(_INIT_ENGINE, LogParser._read_init_engine),
    LineRule(_GRAPH_CAPTURE, LogParser._read_graph_capture),
    LineRule(_BLOCK_SIZE, LogParser._read_block_size, recognised=False),
    LineRule(_NUM_GPU_BLOCKS, LogParser._read_num_blocks),
    LineRule(_SERVER, LogParser._read_server),
    LineRule(_NON_DEFAULT, LogParser._read_non_default),
)


def _larger(current: _N | None, value: _N) -> _N:
    """The larger of a timing kept so far and a new rank's (the slowest rank counts)."""
    return value if current is None else max(current, value)


def _suggestion_problems(ranks: dict[int, RankFigures]) -> list[SuggestionProblem]:
    out: list[SuggestionProblem] = []
    for rank, rf in ranks.items():
        a, b = rf.suggested_kv_bytes_fit, rf.suggested_kv_bytes_full
        if a is not None and a <= 0:
            out.append(SuggestionProblem(
                rank, "fit_not_positive",
                f"rank {rank}: vLLM suggested --kv-cache-memory={a} to fit into requested "
                "memory, which is not positive (CUDA-graph memory counted twice or an "
                "over-estimated graph pool); do not use it, re-profile or lower graph capture",
            ))
        if b is not None and b <= 0:
            out.append(SuggestionProblem(
                rank, "full_not_positive",
                f"rank {rank}: vLLM suggested --kv-cache-memory={b} to fully utilize the "
                "GPU, which is not positive; the profile is unusable",
            ))
        if a is not None and b is not None and a > b:
            out.append(SuggestionProblem(
                rank, "fit_above_full",
                f"rank {rank}: the 'fit into requested memory' suggestion ({a}) is larger "
                f"than the 'fully utilize' suggestion ({b}), which cannot both be right: "
                "the requested memory exceeds the free memory seen at startup",
            ))
    return out


def parse_engine_log(text: str, tp_size: int | None = None) -> EngineLog:
    """Parse a whole engine log (``vllm serve`` output or its journal)."""
    return LogParser(tp_size=tp_size).feed_text(text).result()
