# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""How a rollout walks the fleet: per-class batches and the approved plan artifact.

Plain Python, no Ansible import.

* :func:`class_batches` ramps every class over its own hosts: the serial entries
  (``[1, "10%", "50%"]``, the last one repeating) are sizes or shares *of that class*,
  classes follow one another in the given order and no batch mixes two classes. A class may
  bring a capacity budget (``gpufleet_max_unavailable``,
  :func:`parse_budget`): no batch takes more of the class's serving capacity away at once
  (hosts, a share of its hosts, or the KV-cache tokens its hosts serve); :func:`budget_problems`
  names the hosts a budget can never take away (the class is refused before any host is touched).
  The serial play runs these batches as one ``serial`` list of sizes
  (:func:`serial_sizes`) over the hosts in the same order.
* :func:`gate_violations` (``module_utils/_gate/_free_memory_gate.py``, which the host's write call
  runs too) is the free-memory gate the serial batches run on every host, before its
  instances stop and again after (with what they held counted free).
* :func:`run_settings` collects the run's settings (the play's variables first, else the first
  target host's inventory), reading an AWX survey's text answers for the list settings;
  :func:`check_serial` checks the serial batches as :func:`class_batches` reads them.
* :func:`plan_artifact` builds the document ``plan.yml`` writes (plan -> approve ->
  apply); :func:`plan_drift` says, before any host is touched, what moved between that
  plan and the fleet an apply run finds (compatibility key, reference profile, hosts,
  free memory against the planned floors, the units the plan would write).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any, NamedTuple

from ansible_collections.gpufleet.vllm.plugins.module_utils._gate._floor_check import rank_floor
from ansible_collections.gpufleet.vllm.plugins.module_utils._gate._free_memory_gate import gate_violations
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import plan_file_figures
from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import human_bytes
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._unit_files import secret_serve_args_problem
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError, service_account_name
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._analysis import BAKE_FIELDS, AnalysisError, bake_settings
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._canary_reference import ReferenceError, model_config_from

__all__ = [
    "NEW_PLAN_ON_FAILURE",
    "PLAN_FORMAT",
    "Budget",
    "RolloutError",
    "budget_problems",
    "check_artifact",
    "check_serial",
    "class_batches",
    "class_on_failure",
    "class_settings_problems",
    "gate_violations",
    "host_capacity",
    "parse_budget",
    "plan_artifact",
    "plan_drift",
    "run_settings",
    "serial_sizes",
    "unit_drift",
]

PLAN_FORMAT = "gpufleet.vllm/plan-v2"
_SERIAL_ITEM = re.compile(r"^(?:[1-9][0-9]*|(?:100|[1-9][0-9]?)(?:\.[0-9]+)?%)$")


# The run settings that are lists, which an AWX survey answers as text.
LIST_SETTINGS = ("gpufleet_rollout_serial", "gpufleet_classes")
_BRACKETS = re.compile(r"^\[(.*)\]$")
_QUOTES = re.compile(r"^[\"']|[\"']$")


class RolloutError(ValueError):
    """Bad rollout input; the message names the field."""


BUDGET_FIELD = "gpufleet_max_unavailable"
# what a failed host or a failed bake does to its class: stop there (the hosts of earlier batches keep
# the new plan), or roll every host of the class this run changed back too
ON_FAILURE_FIELD = "gpufleet_on_failure"
ON_FAILURE = ("stop", "rollback_class")
# a class whose group variables do not say: a plan made now rolls the class back (as Argo Rollouts
# aborts to the stable version); an approved plan that does not record it was made before plans
# recorded it, and keeps what it was approved with: stop (class_on_failure)
NEW_PLAN_ON_FAILURE = "rollback_class"
OLD_PLAN_ON_FAILURE = "stop"
_BUDGET_SHARE = re.compile(r"^(?:100|[1-9][0-9]?)(?:\.[0-9]+)?%$")
_BUDGET_TOKENS = re.compile(r"^([1-9][0-9]*)\s*tokens?$")


class Budget(NamedTuple):
    """How much of a class's serving capacity may be away at once: ``hosts`` (a number of hosts),
    ``share`` (a percentage of the class's hosts, rounded down) or ``tokens`` (the KV-cache tokens
    the hosts serve, as their plan records count them); ``given`` is the value as written."""

    kind: str
    amount: float
    given: str

    def hosts(self, class_size: int) -> int | None:
        """Hosts the budget lets go at once in a class of ``class_size`` (None for a token budget)."""
        if self.kind == "hosts":
            return int(self.amount)
        if self.kind == "share":  # rounded down, in decimal: 29 % of 100 hosts is 29
            return int(Decimal(self.given[:-1]) * class_size / 100)
        return None


def parse_budget(value: Any, field: str = BUDGET_FIELD) -> Budget | None:
    """A capacity budget: a positive int (hosts), ``N%`` (a share of the class's hosts) or ``N tokens``;
    None or an empty text is no budget. Raises :class:`RolloutError` naming ``field``."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise RolloutError(f"{field}: a number of hosts must be 1 or more, got {value}")
        return Budget("hosts", value, str(value))
    text = value.strip() if isinstance(value, str) else None
    if text is not None and text.isdigit() and text.isascii():
        return parse_budget(int(text), field)
    if text is not None and _BUDGET_SHARE.match(text):
        return Budget("share", float(text[:-1]), text)
    match = _BUDGET_TOKENS.match(text.lower()) if text is not None else None
    if match:
        return Budget("tokens", int(match.group(1)), text or "")
    raise RolloutError(f"{field}: expected hosts (2), a share of the class's hosts ('25%') or KV-cache tokens ('500000 tokens'), "
                       f"got {value!r}")


def host_capacity(snapshot: Mapping[str, Any]) -> int | None:
    """The KV-cache tokens a host serves, as its plan records count them: the sum of the planned
    ``kv_cache_tokens`` over its active instances (``vllm_host_snapshot``'s ``instances``, each plan
    record in any format it was written in); 0 for a host that serves nothing; None when an active
    instance's plan record gives no figure (an auto_profile plan, a hand-written unit, an unreadable
    record): what it serves is not known."""
    total = 0
    for inst in snapshot.get("instances") or []:
        if not isinstance(inst, Mapping) or inst.get("active_state") != "active":
            continue
        tokens = plan_file_figures(inst.get("plan")).get("kv_cache_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            return None
        total += tokens
    return total


def budget_problems(budget: Budget | None, hosts: Sequence[str], capacity: Mapping[str, int | None] | None = None,
                    gangs: Sequence[Sequence[str]] = ()) -> list[str]:
    """Why ``budget`` cannot roll out the class of ``hosts`` (empty when it can): it lets no host go at
    once, a gang has more members than it lets go, or a host (a gang, all its members) serves more
    tokens than a token budget allows away. A unit whose capacity is not known (None) is not refused:
    it goes in a batch of its own (:func:`class_batches`)."""
    if budget is None or not hosts:
        return []
    allowed = budget.hosts(len(hosts))
    units = _units(hosts, gangs)
    if allowed is not None:
        if allowed < 1:
            return [f"{BUDGET_FIELD} {budget.given} of the class's {len(hosts)} host(s) lets no host be away at once: "
                    f"not even the canary host {hosts[0]} can be rolled out (give at least one host)"]
        wide = [u for u in units if len(u) > allowed]
        return [f"{BUDGET_FIELD} {budget.given} lets {allowed} host(s) be away at once, but the instance over "
                + ", ".join(unit) + f" stops all {len(unit)} of its members together (a gang runs whole or not at all)"
                for unit in wide]
    capacity = capacity or {}
    too_big = [u for u in units if sum(capacity.get(h) or 0 for h in u) > budget.amount]
    if not too_big:
        return []
    return [f"{BUDGET_FIELD} {budget.given} is less than what "
            + ", ".join(f"{u[0] if len(u) == 1 else 'the gang ' + ' + '.join(u)} serves ({sum(capacity.get(h) or 0 for h in u)} "
                        "KV-cache tokens)" for u in too_big)
            + ": that host can never be taken away within the budget"
            + (" (the canary host)" if any(hosts[0] in u for u in too_big) else "")]


def _serial_list(serial: Any, field: str = "gpufleet_rollout_serial") -> list[str]:
    items = serial if isinstance(serial, Sequence) and not isinstance(serial, str) else [serial]
    out = []
    for pos, item in enumerate(items):
        text = str(item).strip()
        if isinstance(item, bool) or not _SERIAL_ITEM.match(text):
            raise RolloutError(f"{field}[{pos}]: expected a positive int or a share 'N%' (0 < N <= 100), got {item!r}")
        out.append(text)
    if not out:
        raise RolloutError(f"{field}: expected at least one batch size")
    return out


def check_serial(serial: Any) -> None:
    """Serial batches :func:`class_batches` takes; else :class:`RolloutError` naming the entry."""
    _serial_list(serial)


def _size(item: str, class_size: int) -> int:
    """Ansible's rule, applied to one class: a share rounds down, every batch holds at least one host."""
    if item.endswith("%"):
        return max(1, int(float(item[:-1]) / 100.0 * class_size))
    return int(item)


def _given(value: Any) -> bool:
    """An AWX survey question left blank comes as an empty text: not given."""
    return not (isinstance(value, str) and value == "")


def _text_list(text: str) -> list[str]:
    """``1,10%,50%`` or ``[1, "10%", "50%"]`` as its items (quotes, blanks and empty items dropped)."""
    text = _BRACKETS.sub(r"\1", text.strip())
    return [item for item in (_QUOTES.sub("", part.strip()) for part in text.split(",")) if item]


def run_settings(names: Iterable[str], given: Mapping[str, Any], inventory: Mapping[str, Any]) -> dict[str, Any]:
    """The run settings ``names``: each from the play's variables (``given``, extra vars first)
    when it is there and not blank, else from the first target host's inventory (``inventory``),
    else left out (the defaults apply). A list setting given as text (an AWX survey answers every
    question as text) becomes its items; serial batches that are all digits become numbers."""
    out: dict[str, Any] = {}
    for name in names:
        for source in (given, inventory):
            if name in source and _given(source[name]):
                out[name] = source[name]
                break
    for name in LIST_SETTINGS:
        value = out.get(name)
        if isinstance(value, str):
            items: list[Any] = _text_list(value)
            if name == "gpufleet_rollout_serial" and all(item.isdigit() and item.isascii() for item in items):
                items = [int(item) for item in items]
            out[name] = items
    return out


# the settings a class gives in its group variables, every host of it alike (the serial batches are the
# run's: an AWX survey always sends its question, as "" when left blank, which would hide a class's own)
CLASS_SETTINGS = (BUDGET_FIELD, ON_FAILURE_FIELD, *BAKE_FIELDS)

# the model's config.json on the controller (path or mapping): only a profiled canary reads it, which a run
# with a stored reference may not start for months, so a wrong path is named before any host is touched
MODEL_CONFIG_FIELD = "gpufleet_model_config"
# the engine's options: a secret among them would reach the canaries (their command line, the profile they record)
# before the check of every host's service inputs refuses it, so it is refused with the class's settings
SERVE_ARGS_FIELD = "gpufleet_serve_args"
# the user the canaries and the units run as: never root, refused before a canary drains its host
SERVICE_USER_FIELD = "vllm_service_user"


def model_config_problem(value: Any, field: str = MODEL_CONFIG_FIELD) -> str | None:
    """What is wrong with ``value`` as a class's model config, as the profiled canary's reference reads it
    (``model_config_from``): a mapping, or the path of a readable JSON object; a false value (None, empty text) is
    unset, as the canary takes it. A relative path is found by the canary's role (its ``files/``), so it is read
    there, not here."""
    def read(path: str) -> str:
        try:
            with open(path, encoding="utf-8") as handle:
                return handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ReferenceError(f"{field}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None

    if not value or (isinstance(value, str) and not value.startswith("/")):
        return None
    try:
        model_config_from(value, None, read, field)
    except ReferenceError as exc:
        return str(exc)
    return None


def parse_on_failure(value: Any, field: str = ON_FAILURE_FIELD, unset: str = NEW_PLAN_ON_FAILURE) -> str:
    """A class's failure policy (:data:`ON_FAILURE`); None or an empty text (a blank AWX answer) is ``unset``."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return unset
    if value not in ON_FAILURE:
        raise RolloutError(f"{field}: expected one of {', '.join(ON_FAILURE)}, got {value!r}")
    return str(value)


def class_on_failure(given: Any, host_class: str, approved_plan: Any = None) -> str:
    """The failure policy of ``host_class`` in this run: ``given`` (its ``gpufleet_on_failure``) when set;
    else, applying an approved plan, what that plan recorded for the class (:func:`plan_artifact`), and
    ``stop`` for a plan that records none (made before plans recorded it: it was approved with stop);
    else, a plan made in this run, :data:`NEW_PLAN_ON_FAILURE`."""
    if not (given is None or (isinstance(given, str) and not given.strip())):
        return parse_on_failure(given)
    if isinstance(approved_plan, Mapping):
        recorded = ((approved_plan.get("classes") or {}).get(host_class) or {}).get("on_failure")
        return parse_on_failure(recorded, f"gpufleet_plan.classes.{host_class}.on_failure", unset=OLD_PLAN_ON_FAILURE)
    return NEW_PLAN_ON_FAILURE


def _serve_args_secret_problem(serve_args: Any) -> str | None:
    """:func:`secret_serve_args_problem` of a class's serve args, given as a mapping or as the JSON text the argument
    spec's dict type (and the canary) accept."""
    if isinstance(serve_args, str):
        try:
            serve_args = json.loads(serve_args)
        except ValueError:
            return None  # not JSON: the argument spec refuses it, naming the variable
    return secret_serve_args_problem(serve_args, SERVE_ARGS_FIELD) if isinstance(serve_args, Mapping) else None


def class_settings_problems(hosts: Mapping[str, Mapping[str, Any]], classes: Collection[str] = ()) -> list[str]:
    """What is wrong with the per-class settings of ``hosts`` (host -> its variables: ``gpufleet_host_class``,
    :data:`CLASS_SETTINGS`, :data:`MODEL_CONFIG_FIELD`, :data:`SERVE_ARGS_FIELD` and :data:`SERVICE_USER_FIELD`): each
    of :data:`CLASS_SETTINGS` must be valid and the same on every host of a class; the model config must be one the
    class's profiled canary can read (only for ``classes``, the run's, when given: the file is this controller's); the
    serve args must hold no secret, and the service user must not be root."""
    problems: list[str] = []
    by_class: dict[str, list[str]] = {}
    for host in sorted(hosts):
        by_class.setdefault(str(hosts[host].get("gpufleet_host_class")), []).append(host)
    for cls, members in sorted(by_class.items()):
        alike = True
        for name in CLASS_SETTINGS:
            given = {h: hosts[h].get(name) for h in members}
            first = given[members[0]]
            if any(value != first for value in given.values()):
                alike = False
                problems.append(f"class {cls}: its hosts give different {name} ("
                                + "; ".join(f"{h}: {v!r}" for h, v in given.items())
                                + "); set it once in the class's group variables")
        if not alike:
            continue
        own = hosts[members[0]]
        try:
            parse_budget(own.get(BUDGET_FIELD), BUDGET_FIELD)
            parse_on_failure(own.get(ON_FAILURE_FIELD))
            bake_settings(*(own.get(name) for name in BAKE_FIELDS))
        except (RolloutError, AnalysisError) as exc:
            problems.append(f"class {cls}: {exc}")
    for cls, members in sorted(by_class.items()):
        configs: dict[str, list[str]] = {}
        for host in members:
            found = [_serve_args_secret_problem(hosts[host].get(SERVE_ARGS_FIELD))]
            if not classes or cls in classes:
                found.append(model_config_problem(hosts[host].get(MODEL_CONFIG_FIELD)))
            if hosts[host].get(SERVICE_USER_FIELD):
                try:
                    service_account_name(hosts[host][SERVICE_USER_FIELD], SERVICE_USER_FIELD)
                except ValidationError as exc:
                    found.append(str(exc))
            for problem in found:
                if problem:
                    configs.setdefault(problem, []).append(host)
        problems += [f"class {cls}: {problem}" + ("" if len(found) == len(members) else f" (on {', '.join(found)})")
                     for problem, found in configs.items()]
    return problems


def _units(hosts: Sequence[str], gangs: Sequence[Sequence[str]]) -> list[list[str]]:
    """``hosts`` as the units a batch takes whole: each gang's members together (leader first, where its
    first member comes in ``hosts``), every other host alone."""
    gang_of = {member: list(gang) for gang in gangs for member in gang}
    units: list[list[str]] = []
    placed: set[str] = set()
    for host in hosts:
        if host in placed:
            continue
        unit = gang_of.get(host, [host])
        placed.update(unit)
        units.append(unit)
    return units


def _cut(hosts: Sequence[str], items: Sequence[str], budget: Budget | None, capacity: Mapping[str, int | None],
         gangs: Sequence[Sequence[str]] = ()) -> list[list[str]]:
    """One class's batches: each serial entry's size, within the budget (at least one unit a batch;
    :func:`budget_problems` refuses a class where that unit would exceed it). A gang (an instance over
    several hosts) is one unit: never split across batches, counted once by the serial sizes, all its
    members away at once under a budget. Under a token budget a unit whose capacity is not known (None)
    goes in a batch of its own."""
    units = _units(hosts, gangs)
    allowed = budget.hosts(len(hosts)) if budget is not None else None
    left = units
    batches: list[list[str]] = []
    step = 0
    while left:
        size = min(_size(items[step], len(units)), len(left))
        if allowed is not None:
            hosts_in = 0
            for count, unit in enumerate(left[:size], start=1):
                hosts_in += len(unit)
                if hosts_in > allowed and count > 1:
                    size = count - 1
                    break
        elif budget is not None:  # tokens: the batch's hosts serve no more than the budget, together
            taken = 0
            for count, unit in enumerate(left[:size], start=1):
                served = [capacity.get(host, 0) for host in unit]
                if any(c is None for c in served):  # not known: alone
                    size = max(1, count - 1)
                    break
                taken += sum(c for c in served if c is not None)
                if taken > budget.amount and count > 1:
                    size = count - 1
                    break
        batches.append([host for unit in left[:size] for host in unit])
        left = left[size:]
        step = min(step + 1, len(items) - 1)
    return batches


def _class_gangs(given: Any, hosts: Sequence[str], field: str) -> list[list[str]]:
    """A class's gangs as ``class_batches`` takes them: lists of two or more of its hosts (the leader first),
    a host in one gang at most; a gang with a member the class does not roll out cannot run whole."""
    if given is None:
        return []
    if not isinstance(given, Sequence) or isinstance(given, (str, Mapping)):
        raise RolloutError(f"{field}: expected a list of gangs, each a list of member hosts, got {given!r}")
    gangs: list[list[str]] = []
    seen: dict[str, int] = {}
    for i, gang in enumerate(given):
        if not isinstance(gang, Sequence) or isinstance(gang, (str, Mapping)) or len(gang) < 2 \
                or not all(isinstance(h, str) and h for h in gang) or len(set(gang)) != len(gang):
            raise RolloutError(f"{field}[{i}]: expected two or more distinct member hosts, leader first, got {gang!r}")
        outside = [h for h in gang if h not in hosts]
        if outside:
            raise RolloutError(f"{field}[{i}]: {', '.join(outside)} of the gang {', '.join(gang)} is/are not rolled out with the "
                               "class; a gang runs on all of its members or not at all")
        for host in gang:
            if host in seen:
                raise RolloutError(f"{field}[{i}]: {host} is also a member of {field}[{seen[host]}]")
            seen[host] = i
        gangs.append(list(gang))
    return gangs


def class_batches(classes: Sequence[Any], serial: Any) -> list[dict[str, Any]]:
    """Batches of every class, classes in the given order.

    ``classes``: ``[[class, [host, ...]], ...]`` or ``[{class, hosts}, ...]`` (hosts in the
    order they are rolled out); a mapping may also give the class's ``max_unavailable`` budget
    (:func:`parse_budget`), ``capacity`` (host -> the KV-cache tokens it serves, None when not
    known: :func:`host_capacity`), ``bake`` (the class's bake, :func:`_analysis.bake_settings`'s
    result, or None), ``on_failure`` (:func:`parse_on_failure`) and ``gangs`` (the members of each
    instance over several hosts, leader first: each is rolled out whole, in one batch, and counts once in
    the serial sizes). Returns ``[{index, total, class, class_index, class_total, class_first, class_last,
    hosts, bake, on_failure}]`` (and ``gangs``, the batch's, in a class with gangs): ``index``/``total``
    count every batch of the run, ``class_index``/``class_total`` the batches of that class, ``bake``
    the class's bake (None: none), ``on_failure`` its failure policy.
    """
    run_items = _serial_list(serial)
    if not isinstance(classes, Sequence) or isinstance(classes, (str, Mapping)):
        raise RolloutError("classes: expected a list of [class, hosts] pairs in rollout order")
    out: list[dict[str, Any]] = []
    seen_hosts: dict[str, str] = {}
    seen_classes: set[str] = set()
    for pos, entry in enumerate(classes):
        own: Mapping[str, Any] = entry if isinstance(entry, Mapping) else {}
        if isinstance(entry, Mapping):
            name, hosts = entry.get("class"), entry.get("hosts")
        elif isinstance(entry, Sequence) and not isinstance(entry, str) and len(entry) == 2:
            name, hosts = entry[0], entry[1]
        else:
            raise RolloutError(f"classes[{pos}]: expected [class, hosts] or {{class, hosts}}, got {entry!r}")
        if not isinstance(name, str) or not name:
            raise RolloutError(f"classes[{pos}].class: expected a class name, got {name!r}")
        if name in seen_classes:
            raise RolloutError(f"classes[{pos}].class: class {name} is listed twice")
        seen_classes.add(name)
        if not isinstance(hosts, Sequence) or isinstance(hosts, str) or not all(isinstance(h, str) and h for h in hosts):
            raise RolloutError(f"classes[{pos}].hosts: expected a list of host names, got {hosts!r}")
        for host in hosts:
            if host in seen_hosts:
                raise RolloutError(f"classes[{pos}].hosts: {host} is in class {seen_hosts[host]} and in class {name}")
            seen_hosts[host] = name
        budget = parse_budget(own.get("max_unavailable"), f"classes[{pos}].max_unavailable")
        capacity = own.get("capacity") or {}
        if not isinstance(capacity, Mapping):
            raise RolloutError(f"classes[{pos}].capacity: expected host -> KV-cache tokens, got {capacity!r}")
        bake = own.get("bake")
        if bake is not None and not (isinstance(bake, Mapping) and isinstance(bake.get("seconds"), int)):
            raise RolloutError(f"classes[{pos}].bake: expected the class's bake settings (seconds, checks, inconclusive), got {bake!r}")
        on_failure = parse_on_failure(own.get("on_failure"), f"classes[{pos}].on_failure")
        gangs = _class_gangs(own.get("gangs"), hosts, f"classes[{pos}].gangs")
        batches = _cut(hosts, run_items, budget, capacity, gangs)
        for number, group in enumerate(batches, start=1):
            out.append({"class": name, "class_index": number, "class_total": len(batches),
                        "class_first": number == 1, "class_last": number == len(batches), "hosts": group,
                        "bake": dict(bake) if bake else None, "on_failure": on_failure})
            if gangs:
                out[-1]["gangs"] = [list(gang) for gang in gangs if gang[0] in group]
    for index, batch in enumerate(out, start=1):
        batch["index"] = index
        batch["total"] = len(out)
    return out


def class_rollback_hosts(batches: Sequence[Mapping[str, Any]], changed: Mapping[str, bool],
                         failing: Collection[str] = (), active: Collection[str] | None = None,
                         gang_members: Collection[str] = (), gangs_only: bool = False) -> list[str]:
    """The hosts a class rollback restores, in the order it restores them: the hosts of the last
    batch record's class that this run changed (``changed``: host -> whether its units changed), the
    latest batch first and each batch's hosts in reverse (``batches``: the run's batch records, the
    running one last). Of the running batch, the hosts that are not ``failing`` (a failing host rolls
    itself back) and, given ``active`` (Ansible's ``ansible_play_batch``), are still in it: the class
    rollback runs in a failed host's rescue, which the serial play's linear strategy starts once the
    batch's other hosts finished their deploy; a host that dropped out (unreachable) cannot be restored,
    and trying first would leave the earlier batches unrestored. With ``gangs_only``, only the members
    of gangs (``gang_members``) among them: a class rollback restores and restarts them in that order
    too, and checks their boots once every host was restored (a gang's members serve only together,
    and each restarts while the others may still run the new plan)."""
    out = _class_rollback_candidates(batches, changed, failing, active)
    return [h for h in out if h in gang_members] if gangs_only else out


def _class_rollback_candidates(batches: Sequence[Mapping[str, Any]], changed: Mapping[str, bool],
                               failing: Collection[str], active: Collection[str] | None) -> list[str]:
    if not batches:
        return []
    running = batches[-1]
    out = [h for h in reversed(list(running.get("hosts") or []))
           if changed.get(h) and h not in failing and (active is None or h in active)]
    for batch in reversed(batches[:-1]):
        if batch.get("class") == running.get("class"):
            out += [h for h in reversed(list(batch.get("hosts") or [])) if changed.get(h)]
    return out


def serial_sizes(batches: Sequence[Mapping[str, Any]]) -> list[int]:
    """The ``serial`` list that makes Ansible run exactly these batches (hosts in the same order)."""
    return [len(b["hosts"]) for b in batches]


# ---------------------------------------------------------------- the plan artifact
def plan_artifact(classes: Mapping[str, Mapping[str, Any]], hosts: Mapping[str, Mapping[str, Any]],
                  created: str, serial: Any = None) -> dict[str, Any]:
    """The document plan.yml writes and rollout.yml applies.

    ``classes``: ``{class: {decision, ok, reasons, plan, key_hash, compat, reference_id, on_failure}}``
    (``plan`` is the class's plan from the planner, its launch record under ``launch``;
    ``class_states`` builds them from the hosts' class states); ``hosts``: ``{host: {class,
    instances: [{name, gpus, unit_checksum?}], gpus: [{index, boot_free_bytes}], units?: [{name, unit_checksum}]}}``
    (an instance without its own ``unit_checksum`` takes its unit's from ``units``, ``vllm_service``'s status of the host).
    Every figure an apply run checks is kept: per class the decision, budget, floors,
    utilization, tokens, reference id and compatibility key; per host its instances' GPUs,
    the unit checksum the plan writes and the free memory seen when planning.
    """
    out_classes: dict[str, Any] = {}
    for name, cls in sorted(classes.items()):
        plan = dict(cls.get("plan") or {})
        # the class's verdict is its "deployable" below (kv_plan's rule, or false when the class failed after
        # planning, say on its manual canary): kv_plan's own copy in the plan would contradict it then
        plan.pop("deployable", None)
        # the figures an approver reads, from the class's launch record (a class that failed before planning has none)
        launch = plan.get("launch") or {}
        expect = launch.get("expect") or {}
        out_classes[name] = {
            "deployable": bool(cls.get("ok")),
            "decision": launch.get("decision", "none"),
            "reasons": [str(r) for r in cls.get("reasons") or []],
            "kv_cache_memory_bytes": launch.get("kv_cache_memory_bytes"),
            "free_floor_bytes": {str(k): int(v) for k, v in (launch.get("free_floor_bytes") or {}).items()},
            "gpu_memory_utilization": launch.get("gpu_memory_utilization"),
            "kv_cache_tokens": expect.get("kv_cache_tokens"),
            "reference_id": cls.get("reference_id") or None,
            "key_hash": cls.get("key_hash") or None,
            "compat": dict(cls.get("compat") or {}),
            # what a failed host or bake does to the class when the apply run's inventory does not say (class_on_failure)
            "on_failure": parse_on_failure(cls.get("on_failure"), f"classes.{name}.on_failure"),
            "plan": plan,
            "hosts": sorted(h for h, hv in hosts.items() if hv.get("class") == name),
        }
    out_hosts: dict[str, Any] = {}
    for host, facts in sorted(hosts.items()):
        # the checksum of each unit the plan writes, from vllm_service's status of the host
        checksums = {u.get("name"): u.get("unit_checksum") for u in facts.get("units") or [] if isinstance(u, Mapping)}
        out_hosts[host] = {
            "class": facts.get("class"),
            "instances": [
                {"name": i.get("name"), "gpus": [int(g) for g in i.get("gpus") or []],
                 "unit_checksum": i.get("unit_checksum") or checksums.get(i.get("name"))}
                for i in facts.get("instances") or []
            ],
            "boot_free_bytes": {str(g["index"]): int(g["boot_free_bytes"]) for g in facts.get("gpus") or [] if "boot_free_bytes" in g},
        }
    return {"format": PLAN_FORMAT, "created": created, "serial": serial, "classes": out_classes, "hosts": out_hosts}


def check_artifact(doc: Any) -> dict[str, Any]:
    """The artifact itself is well formed (an error names the field)."""
    if not isinstance(doc, Mapping):
        raise RolloutError(f"gpufleet_plan: expected the mapping plan.yml writes, got {type(doc).__name__}")
    if doc.get("format") != PLAN_FORMAT:
        raise RolloutError(f"gpufleet_plan.format: expected {PLAN_FORMAT!r}, got {doc.get('format')!r}")
    for field in ("classes", "hosts"):
        if not isinstance(doc.get(field), Mapping):
            raise RolloutError(f"gpufleet_plan.{field}: expected a mapping")
    for name, cls in doc["classes"].items():
        if not isinstance(cls, Mapping) or not isinstance(cls.get("plan"), Mapping):
            raise RolloutError(f"gpufleet_plan.classes.{name}.plan: expected the class's plan")
        if cls["plan"] and not isinstance(cls["plan"].get("launch"), Mapping):
            raise RolloutError(f"gpufleet_plan.classes.{name}.plan.launch: expected the class's launch record")
        if not isinstance(cls.get("hosts"), list):
            raise RolloutError(f"gpufleet_plan.classes.{name}.hosts: expected a list of hosts")
    for name, host in doc["hosts"].items():
        if not isinstance(host, Mapping) or not isinstance(host.get("instances"), list):
            raise RolloutError(f"gpufleet_plan.hosts.{name}.instances: expected a list")
    return dict(doc)


def plan_drift(doc: Any, host_class: str, current: Mapping[str, Any]) -> list[str]:
    """What moved between the approved plan and the fleet now, for one class; empty when nothing did.

    ``current``: ``{key_hash, compat, reference_id, hosts: {host: [gpu facts]}}`` for the class
    as the apply run finds it (``gpu facts``: ``{index, boot_free_bytes}``, as
    ``gpu_memory_info`` returns them). Free memory is compared with the plan's floor of
    each instance rank (NVML with NVML), never with the free memory seen when planning.
    """
    plan = check_artifact(doc)
    cls = plan["classes"].get(host_class)
    if cls is None:
        return [f"class {host_class} is not in the approved plan (it has {', '.join(sorted(plan['classes'])) or 'no class'})"]
    moved: list[str] = []
    if not cls.get("deployable"):
        moved.append(f"class {host_class} was not deployable in the approved plan ({cls.get('decision')}): "
                     + "; ".join(cls.get("reasons") or []))
    if current.get("key_hash") != cls.get("key_hash"):
        planned = cls.get("compat") or {}
        now = current.get("compat") or {}
        fields = sorted(k for k in set(planned) | set(now) if planned.get(k) != now.get(k))
        moved.append(f"class {host_class}: the compatibility key changed"
                     + (f" ({', '.join(f'{f}: {planned.get(f)!r} -> {now.get(f)!r}' for f in fields)})" if fields else
                        f" ({cls.get('key_hash')} -> {current.get('key_hash')})"))
    if (current.get("reference_id") or None) != cls.get("reference_id"):
        moved.append(f"class {host_class}: the reference profile changed ({cls.get('reference_id')} -> {current.get('reference_id')})")
    hosts_now = current.get("hosts") or {}
    planned_hosts = list(cls.get("hosts") or [])
    added = sorted(set(hosts_now) - set(planned_hosts))
    gone = sorted(set(planned_hosts) - set(hosts_now))
    if added:
        moved.append(f"class {host_class}: hosts not in the approved plan: {', '.join(added)}")
    if gone:
        moved.append(f"class {host_class}: planned hosts missing from this run: {', '.join(gone)}")
    launch = cls["plan"].get("launch") or {}
    floors = launch.get("free_floor_bytes") or {}
    # an instance over several hosts (a gang) keys its floors by the rank in the whole instance: the plan's per-rank
    # table names the member host and GPU of each such rank
    gang_ranks = {(str(r["member"]), int(r["gpu"])): int(r["rank"]) for r in cls["plan"].get("per_rank") or []
                  if isinstance(r, Mapping) and r.get("member") is not None and r.get("gpu") is not None}
    if launch.get("kv_cache_memory_bytes") and floors:
        for host in planned_hosts:
            if host not in hosts_now:
                continue
            gpus = {int(g["index"]): g for g in hosts_now[host] or [] if isinstance(g, Mapping) and "index" in g}
            planned_free = (plan["hosts"].get(host) or {}).get("boot_free_bytes") or {}
            for inst in (plan["hosts"].get(host) or {}).get("instances") or []:
                for rank, index in enumerate(inst.get("gpus") or []):
                    floor = rank_floor(floors, gang_ranks.get((host, int(index)), rank))
                    if floor is None:
                        continue
                    gpu = gpus.get(int(index))
                    if gpu is None:
                        moved.append(f"{host} {inst.get('name')} rank {rank} (GPU {index}): the GPU is gone")
                        continue
                    free = int(gpu.get("boot_free_bytes", 0))
                    if free < floor:
                        was = planned_free.get(str(index))
                        moved.append(
                            f"{host} {inst.get('name')} rank {rank} (GPU {index}): free memory {human_bytes(free)} ({free}) "
                            f"is below the planned floor {human_bytes(floor)} ({floor})"
                            + (f"; it was {human_bytes(int(was))} ({was}) when planned" if was is not None else ""))
    return moved


def unit_drift(doc: Any, host: str, statuses: Sequence[Mapping[str, Any]]) -> list[str]:
    """The units this run would write on ``host`` are the ones the approved plan showed (by checksum)."""
    plan = check_artifact(doc)
    planned = {i.get("name"): i.get("unit_checksum") for i in (plan["hosts"].get(host) or {}).get("instances") or []}
    if host not in plan["hosts"]:
        return [f"{host} is not in the approved plan"]
    moved = []
    # instance names as the unit statuses give them (task results, not checked here), like the plan's
    now: dict[Any, Any] = {s.get("name"): s.get("unit_checksum") for s in statuses}
    for name in sorted(set(planned) | set(now)):
        if name not in now:
            moved.append(f"{host}: instance {name} of the approved plan is not in this run's inventory")
        elif name not in planned:
            moved.append(f"{host}: instance {name} is not in the approved plan")
        elif planned[name] != now[name]:
            moved.append(f"{host}: the unit of instance {name} differs from the approved plan "
                         f"(checksum {planned[name]} planned, {now[name]} now)")
    return moved
