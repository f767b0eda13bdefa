# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Bad input never gets through: generated values outside their domain, of every type, fed to
every filter, action, module edge, the planner and the profile store.

Each call must end in the entry point's documented error (AnsibleFilterError, a failed
action result, PlanError, ProfileStoreError, UnitFilesError, EngineSpecError, SizeError,
ValidationError) whose message names the field. Any other exception is a traceback the
user would see instead of the field; a return is a silent acceptance. Both fail the test.
The counts are printed by the last test (``pytest -s``) and checked: no traceback, no
silent acceptance, no file written outside the store.
"""

from __future__ import annotations

import collections
import math
import os
from typing import Any, Callable
from unittest.mock import MagicMock

import pytest
from ansible.errors import AnsibleActionFail, AnsibleFilterError
from hypothesis import HealthCheck, given, settings, strategies as st

from ansible_collections.gpufleet.vllm.plugins.action.kv_plan import ActionModule as KvPlan
from ansible_collections.gpufleet.vllm.plugins.action.kv_profile import ActionModule as KvProfile
from ansible_collections.gpufleet.vllm.plugins.filter.kv import FilterModule as KvFilters
from ansible_collections.gpufleet.vllm.plugins.filter.serve import FilterModule as ServeFilters
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._canary import canary_env
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._serve_argv import EngineSpecError
from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu import _gpu_memory
from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import SizeError, parse_size
from ansible_collections.gpufleet.vllm.plugins.module_utils._units import _unit_files as uf
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError
from ansible_collections.gpufleet.vllm.plugins.modules import vllm_boot_check, vllm_canary
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import PlanError, plan_class
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._profile_store import ProfileStore, ProfileStoreError

F = {**KvFilters().filters(), **ServeFilters().filters()}
COUNTS: collections.Counter[str] = collections.Counter()
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# ------------------------------------------------------------------ bad values

CONTROL = st.sampled_from(["\n", "\r", "\t", "\x00", "\x1b", "\x7f", "\x85", "\u2028"])


def with_control(base: st.SearchStrategy[str] = st.from_regex(r"[a-z0-9]{0,4}", fullmatch=True)) -> st.SearchStrategy[str]:
    return st.builds(lambda a, c, b: a + c + b, base, CONTROL, base)


CONTAINERS = st.one_of(st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
BAD_NUMBER = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, "nan", "inf", "-inf", "1e400", "abc", "", True, False, None, "9" * 100]),
    CONTAINERS, with_control(st.just("1")))
BAD_PORT = st.one_of(st.integers(max_value=0), st.integers(min_value=65536), BAD_NUMBER,
                     st.floats(min_value=1.01, max_value=65534.99).filter(lambda f: not f.is_integer()))
BAD_SIZE = st.one_of(
    st.integers(max_value=-1), st.integers(min_value=2**63, max_value=2**80),
    st.sampled_from(["1e999999", "1e400", "-1GiB", "0.3B", "5XB", "inf", "nan", "5\n", "1e-999999", True, None, [], {},
                     "1" * 80, "GiB", "1.5.5G"]),
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda f: not (math.isfinite(f) and f.is_integer() and 0 <= f < 2**63)),
    with_control(st.just("5")))
BAD_SIZE_GIVEN = BAD_SIZE.filter(lambda x: x is not None)
BAD_NAME = st.one_of(with_control(st.from_regex(r"[a-z]{1,5}", fullmatch=True)),
                     st.sampled_from(["", ".", "..", "-x", "a/b", "a b", "caf\u00e9", "\u0430bc", "x" * 200, "a\n"]),
                     st.integers(), st.none(), st.lists(st.text(max_size=2), max_size=1))
BAD_BOOL = st.one_of(st.sampled_from(["maybe", "2", "", "yess", "nope", "truee"]), st.integers(min_value=2),
                     st.integers(max_value=-1), st.floats(min_value=0.1, max_value=0.9), st.lists(st.booleans(), max_size=1))
BAD_TEXT = st.one_of(with_control(st.text(alphabet="ab $%\"'\\", max_size=4)), CONTAINERS, st.none(), st.booleans())

# ------------------------------------------------------------------ the check


def refused(call: Callable[[], Any], errors: tuple[type[BaseException], ...], field: str) -> None:
    """``call()`` must raise one of ``errors`` naming ``field``: anything else is counted and fails."""
    COUNTS["tried"] += 1
    try:
        result = call()
    except errors as exc:
        if field not in str(exc):
            COUNTS["unclear"] += 1
            raise AssertionError(f"error does not name {field!r}: {exc}") from None
        COUNTS["clear"] += 1
        return
    except Exception:
        COUNTS["tracebacks"] += 1
        raise
    if isinstance(result, dict) and result.get("failed"):  # an action's failed result
        if field not in str(result.get("msg")):
            COUNTS["unclear"] += 1
            raise AssertionError(f"failure does not name {field!r}: {result.get('msg')}")
        COUNTS["clear"] += 1
        return
    if isinstance(result, list) and result and all(isinstance(p, str) for p in result):  # a list of problems
        if not any(field in p for p in result):
            COUNTS["unclear"] += 1
            raise AssertionError(f"problems do not name {field!r}: {result}")
        COUNTS["clear"] += 1
        return
    COUNTS["silent"] += 1
    raise AssertionError(f"accepted silently: {result!r}")


FILTER_ERR = (AnsibleFilterError,)

# ------------------------------------------------------------------ filters


@SETTINGS
@given(BAD_SIZE)
def test_to_bytes(value):
    refused(lambda: F["to_bytes"](value, "guard"), FILTER_ERR, "guard")


@SETTINGS
@given(BAD_BOOL)
def test_human_bytes_exact(value):
    refused(lambda: F["human_bytes"](1024, 2, value), FILTER_ERR, "human_bytes exact")


@SETTINGS
@given(st.one_of(BAD_NUMBER, st.integers(max_value=-1), st.integers(min_value=21)))
def test_human_bytes_precision(value):
    refused(lambda: F["human_bytes"](1024, value), FILTER_ERR, "precision")


@SETTINGS
@given(st.sampled_from(["head_dim", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size"]),
       st.one_of(st.integers(max_value=0), st.sampled_from(["x", 1.5, True, [], "8"])))
def test_kv_bytes_per_token_config(key, value):
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "torch_dtype": "bfloat16", key: value}
    refused(lambda: F["kv_bytes_per_token"](config), FILTER_ERR, key)


@SETTINGS
@given(st.one_of(with_control(st.just("max_model_len")), st.sampled_from(["", "a b", "x=y", "--", "é"])), st.integers())
def test_vllm_serve_argv_key(key, value):
    refused(lambda: F["vllm_serve_argv"]({key: value}), FILTER_ERR, "serve_args")


@SETTINGS
@given(st.one_of(with_control(), st.sampled_from([math.nan, math.inf, "--port", "--api-key=x"]),
                 st.lists(with_control(), min_size=1, max_size=2)))
def test_vllm_serve_argv_value(value):
    refused(lambda: F["vllm_serve_argv"]({"served_model_name": value}), FILTER_ERR, "served_model_name")


@SETTINGS
@given(BAD_TEXT.filter(lambda x: not isinstance(x, bool)))
def test_systemd_exec_start_word(value):
    refused(lambda: F["systemd_exec_start"](["serve", value], "/opt/vllm/bin/vllm"), FILTER_ERR, "ExecStart[1]")


@SETTINGS
@given(st.one_of(BAD_TEXT, st.sampled_from(["relative/vllm", "/a b/vllm", "/a/../vllm"])))
def test_systemd_exec_start_executable(value):
    refused(lambda: F["systemd_exec_start"](["serve"], value), FILTER_ERR, "ExecStart executable")


@SETTINGS
@given(BAD_NAME.filter(lambda n: not (isinstance(n, str) and n and n.isidentifier() and n.isascii())))
def test_systemd_environment_name(name):
    refused(lambda: F["systemd_environment"]("v", name, "vllm_service_env"), FILTER_ERR, "vllm_service_env name")


@SETTINGS
@given(BAD_TEXT)
def test_systemd_environment_value(value):
    refused(lambda: F["systemd_environment"](value, "NOTE", "vllm_service_env"), FILTER_ERR, "vllm_service_env.NOTE")


@SETTINGS
@given(BAD_TEXT)
def test_systemd_environment_file_value(value):
    refused(lambda: F["systemd_environment_file"]({"HF_TOKEN": value}), FILTER_ERR, "secret_env.HF_TOKEN")


@SETTINGS
@given(st.one_of(BAD_TEXT, st.just("vllm\\")))
def test_systemd_value(value):
    refused(lambda: F["systemd_value"](value, "vllm_service_user"), FILTER_ERR, "vllm_service_user")


ROLE_OK = {
    "vllm_service_instances": [{"name": "main", "gpus": [0], "port": 8000}],
    "vllm_service_plan": {"decision": "deploy", "kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": 0.5},
    "vllm_service_model": "/srv/m", "vllm_service_executable": "/opt/vllm/venv/bin/vllm",
    "vllm_service_home": "/var/lib/vllm", "vllm_service_state_dir": "/etc/gpufleet",
    "vllm_service_unit_dir": "/etc/systemd/system", "vllm_service_user": "vllm", "vllm_service_group": "vllm",
    "vllm_service_listen_host": "0.0.0.0",
}
ROLE_BAD = st.one_of(
    st.tuples(st.just("vllm_service_instances"), st.builds(lambda p: [{"name": "main", "gpus": [0], "port": p}], BAD_PORT),
              st.just("port")),
    st.tuples(st.just("vllm_service_instances"), st.builds(lambda n: [{"name": n, "gpus": [0], "port": 8000}], BAD_NAME),
              st.just("name")),
    st.tuples(st.just("vllm_service_instances"),
              st.sampled_from([[{"name": "main", "gpus": [0, 0], "port": 8000}],
                               [{"name": "a", "gpus": [0], "port": 8000}, {"name": "b", "gpus": [0], "port": 8001}],
                               [{"name": "a", "gpus": [0], "port": 8000}, {"name": "a", "gpus": [1], "port": 8001}],
                               [{"name": "a", "gpus": [-1], "port": 8000}], [{"name": "a", "gpus": [], "port": 8000}]]),
              st.just("vllm_service_instances")),
    st.tuples(st.just("vllm_service_plan"), st.builds(lambda u: dict(ROLE_OK["vllm_service_plan"], gpu_memory_utilization=u),
                                                      st.one_of(BAD_NUMBER, st.floats(min_value=1.01, max_value=1e9))),
              st.just("gpu_memory_utilization")),
    st.tuples(st.sampled_from(["vllm_service_home", "vllm_service_executable", "vllm_service_state_dir",
                               "vllm_service_boot_gate_python", "vllm_service_boot_gate_bin", "vllm_service_boot_gate_lib_dir",
                               "vllm_service_metrics_textfile_dir", "vllm_service_metrics_python", "vllm_service_metrics_bin"]),
              st.one_of(BAD_TEXT, st.sampled_from(["relative", "/a b", "/a/../b"])), st.just("")),
    st.tuples(st.sampled_from(["vllm_service_metrics", "vllm_service_boot_check"]), BAD_BOOL, st.just("")),
    st.tuples(st.just("vllm_service_metrics_interval_sec"), st.sampled_from([0, -1, "x", 1.5, None]), st.just("")),
    st.tuples(st.just("vllm_service_boot_gate"), st.sampled_from(["", "Shrink", "skip", None, 1]), st.just("")),
    st.tuples(st.just("vllm_service_health_host"), st.one_of(BAD_TEXT, st.just("127.0.0.1 x")), st.just("")),
    st.tuples(st.sampled_from(["vllm_service_user", "vllm_service_group"]), BAD_NAME, st.just("")),
    st.tuples(st.just("vllm_service_create_user"), BAD_BOOL, st.just("")),
    st.tuples(st.sampled_from(["vllm_service_gate_interval", "vllm_service_auto_gpu_memory_utilization"]),
              BAD_NUMBER, st.just("")),
    st.tuples(st.just("vllm_service_model"), st.one_of(BAD_TEXT, st.just("--api-key")), st.just("")),
)


@SETTINGS
@given(ROLE_BAD)
def test_vllm_service_problems(bad):
    key, value, sub = bad
    field = key if not sub else sub
    refused(lambda: F["vllm_service_problems"](dict(ROLE_OK, **{key: value})), FILTER_ERR, field)


def test_vllm_service_problems_accepts_the_good_inputs():
    assert F["vllm_service_problems"](ROLE_OK) == []
    # the role's defaults of the boot gate's and the exporter's settings
    defaults = {"vllm_service_boot_gate": "shrink", "vllm_service_boot_gate_python": "/opt/vllm/venv/bin/python3",
                "vllm_service_boot_gate_bin": "/usr/local/libexec/gpufleet-vllm-boot-gate",
                "vllm_service_boot_gate_lib_dir": "/usr/local/lib/gpufleet-vllm", "vllm_service_metrics": True,
                "vllm_service_metrics_textfile_dir": "/var/lib/prometheus/node-exporter", "vllm_service_metrics_interval_sec": 60,
                "vllm_service_metrics_python": "/opt/vllm/venv/bin/python3",
                "vllm_service_metrics_bin": "/usr/local/libexec/gpufleet-vllm-metrics", "vllm_service_health_host": "127.0.0.1",
                "vllm_service_compat_key_hash": ""}
    assert F["vllm_service_problems"](dict(ROLE_OK, **defaults)) == []


# ------------------------------------------------------------------ actions


def action(cls, args):
    task = MagicMock()
    task.args = args
    task.async_val = 0
    task.check_mode = False
    task.diff = False
    connection = MagicMock()
    connection._shell.tmpdir = "/nonexistent"
    return cls(task, connection, MagicMock(check_mode=False), MagicMock(), MagicMock(), MagicMock())


GIB = 1 << 30
REFERENCE = {"ranks": [{"rank": 0, "free_bytes": 42 * GIB, "kv_bytes": 30 * GIB}], "total_bytes": 141 * GIB,
             "bytes_per_block": 2097152}
HOSTS = {"a": [{"rank": 0, "boot_free_bytes": 41 * GIB}]}
PLAN_BAD = st.one_of(
    st.tuples(st.sampled_from(["fit_headroom", "max_capacity_loss", "unstable_share"]),
              st.sampled_from([math.inf, math.nan, -1.0, "inf", "nan"])),
    # None is "not given" (the default) for these, so it is left out
    st.tuples(st.just("guard_bytes"), BAD_SIZE_GIVEN),
    st.tuples(st.just("reference.block_size"), st.one_of(st.just(0), BAD_SIZE_GIVEN)),
    st.tuples(st.just("reference.total_bytes"), st.one_of(st.integers(min_value=1, max_value=42 * GIB - 1), BAD_SIZE_GIVEN)),
    st.tuples(st.just("unstable"), BAD_BOOL),
    st.tuples(st.just("free_min_bytes"), st.integers(min_value=41 * GIB + 1, max_value=2**62)),
)


def _plan_spec(key: str, value: Any) -> tuple[dict[str, Any], str]:
    spec: dict[str, Any] = {"host_class": "h200", "reference": dict(REFERENCE), "hosts": {"a": [dict(HOSTS["a"][0])]},
                            "guard_bytes": GIB // 2, "max_model_len": 8192}
    if key.startswith("reference."):
        spec["reference"][key.split(".", 1)[1]] = value
        return spec, key
    if key == "unstable":
        spec["hosts"]["a"][0]["unstable"] = value
        return spec, "unstable"
    if key == "free_min_bytes":
        spec["hosts"]["a"][0].update(free_min_bytes=value, free_max_bytes=41 * GIB)
        return spec, "free_min_bytes"
    spec[key] = value
    return spec, key


@SETTINGS
@given(PLAN_BAD)
def test_planner(bad):
    spec, field = _plan_spec(*bad)
    refused(lambda: plan_class(spec), (PlanError,), field)


@SETTINGS
@given(PLAN_BAD)
def test_kv_plan_action(bad):
    spec, field = _plan_spec(*bad)
    refused(lambda: action(KvPlan, spec).run(task_vars={}), (AnsibleActionFail,), field)


@SETTINGS
@given(BAD_NAME.filter(lambda n: not isinstance(n, int)))  # the argument spec (type str) turns 7 into "7", a valid name
def test_kv_profile_action_host_class(tmp_path, name):
    args = {"store": str(tmp_path / "store"), "host_class": name, "compat": {"model": "m"}, "state": "present",
            "profile": {"ranks": [{"rank": 0, "free_bytes": 1, "kv_bytes": 1}]}}
    refused(lambda: action(KvProfile, args).run(task_vars={}), (AnsibleActionFail,), "host_class")
    assert not os.path.exists(tmp_path / "store") or os.listdir(tmp_path / "store") in ([], [".lock"])


# ------------------------------------------------------------------ module edges


GPU_BAD = st.one_of(st.tuples(st.just("samples"), st.one_of(st.integers(max_value=0), st.integers(min_value=1001))),
                    st.tuples(st.just("interval"), st.sampled_from([math.nan, math.inf, -1.0, 1e9])),
                    st.tuples(st.just("service_units"), st.lists(with_control(), min_size=1, max_size=2)))


@SETTINGS
@given(GPU_BAD)
def test_gpu_memory_info_params(bad):
    key, value = bad
    params = dict({"devices": None, "samples": 1, "interval": 1.0, "service_units": [], "service_pids": []}, **{key: value})
    refused(lambda: _gpu_memory.check_params(params), (ValidationError,), key)


BOOT_OK = {"unit": "vllm-a.service", "url": None, "host": "127.0.0.1", "port": 8000, "expected_kv_cache_memory_bytes": None,
           "free_floor_bytes": None, "min_tokens": None, "timeout": 900, "journal": True, "log_path": None}
BOOT_BAD = st.one_of(st.tuples(st.just("port"), st.one_of(st.integers(max_value=0), st.integers(min_value=65536))),
                     st.tuples(st.just("url"), st.sampled_from(["http://h:70000", "http://h:-1", "ftp://h", "http://h\n:1"])),
                     st.tuples(st.just("host"), st.one_of(with_control(), st.sampled_from(["10.0.0.1 x", "h/1", "\t"]))),
                     st.tuples(st.just("unit"), with_control()),
                     st.tuples(st.just("timeout"), st.integers(max_value=0)),
                     st.tuples(st.just("expected_kv_cache_memory_bytes"), BAD_SIZE.filter(lambda x: x is not None)),
                     st.tuples(st.just("free_floor_bytes"), st.builds(lambda s: {"0": s}, BAD_SIZE)))


@SETTINGS
@given(BOOT_BAD)
def test_vllm_boot_check_spec(bad):
    key, value = bad
    refused(lambda: vllm_boot_check.build_spec(dict(BOOT_OK, **{key: value})),
            (ValidationError, EngineSpecError, SizeError), key.split("_bytes")[0] if key not in ("url", "host") else key)


CANARY_OK = {"executable": "/opt/vllm/bin/vllm", "model": "/srv/m", "mode": "profiled", "kv_cache_memory_bytes": None,
             "gpu_memory_utilization": None, "serve_args": {}, "env": {}, "port": None, "startup_timeout": 900,
             "stop_timeout": 30, "load": {}, "reference": None, "tolerances": {}, "log_path": None,
             "cuda_visible_devices": None, "user": None, "group": None}
CANARY_BAD = st.one_of(
    st.tuples(st.just("port"), st.one_of(st.integers(max_value=0), st.integers(min_value=65536))),
    st.tuples(st.just("gpu_memory_utilization"), st.sampled_from([math.nan, math.inf, 0.0, 1.5, -0.1])),
    st.tuples(st.just("serve_args"), st.builds(lambda v: {"chat_template": v}, with_control())),
    st.tuples(st.just("env"), st.builds(lambda n: {n: "1"}, BAD_NAME.filter(lambda n: n is not None and not isinstance(n, list)))),
    st.tuples(st.just("model"), st.one_of(with_control(), st.just("--api-key"))),
    st.tuples(st.just("tolerances"), st.sampled_from([{"token_ratio": math.nan}, {"latency_ratio": math.inf},
                                                      {"latency_ratio": 0}, {"preemptions": -1}])),
    # a member of a canary gang: its rank arguments and environment, and what a member without API needs
    st.tuples(st.just("gang"), st.one_of(
        st.builds(lambda v: {"args": ["--node-rank", v]}, with_control()),
        st.builds(lambda n: {"args": ["--headless"], "environment": {n: "x"}},
                  BAD_NAME.filter(lambda n: n is not None and not isinstance(n, list))),
        st.sampled_from([{"args": []}, {"args": ["--headless"], "serves_api": False, "ranks": 1},
                         {"args": ["--headless"], "serves_api": False, "ranks": 0, "stop_file": "/run/s"},
                         {"args": ["--headless"], "serves_api": False, "ranks": 1, "stop_file": "run/s"},
                         {"args": ["--headless"], "serves_api": False, "ranks": 1, "stop_file": "/run/s", "hold_timeout": 0}]))),
)


@SETTINGS
@given(CANARY_BAD)
def test_vllm_canary_spec(bad):
    key, value = bad
    field = {"serve_args": "chat_template", "tolerances": "tolerances.", "gang": "gang."}.get(key, key)

    def call():
        spec = vllm_canary.build_spec(dict(CANARY_OK, **{key: value}))
        vllm_canary.canary_argv(spec, spec.port or 8000)
        return canary_env(spec, base={})

    refused(call, (ValidationError, EngineSpecError, SizeError), field)


@SETTINGS
@given(BAD_NAME)
def test_vllm_unit_instance_names(tmp_path, name):
    layout = uf.Layout(unit_dir=str(tmp_path / "units"), state_dir=str(tmp_path / "state"), uid=os.getuid(),
                       gid=os.getgid(), plan_gid=os.getgid())
    refused(lambda: uf.write(layout, [{"name": name, "unit": "[Unit]\n"}], check=False), (uf.UnitFilesError,),
            "instance name")
    assert not os.path.exists(tmp_path / "units") and not os.path.exists(tmp_path / "state")


@SETTINGS
@given(st.one_of(with_control(st.just('A="x')), st.sampled_from(['A=x', 'A="x"y"', 'bad-name="x"', 'A="$x"', 'A="x\\"'])))
def test_vllm_unit_environment_file_text(tmp_path, line):
    layout = uf.Layout(unit_dir=str(tmp_path / "units"), state_dir=str(tmp_path / "state"), uid=os.getuid(),
                       gid=os.getgid(), plan_gid=os.getgid())
    refused(lambda: uf.write(layout, [{"name": "a", "env": line + "\n"}], check=False), (uf.UnitFilesError,),
            "environment file")
    assert not os.path.exists(tmp_path / "state")


# ------------------------------------------------------------------ profile store

PROFILE = {"ranks": [{"rank": 0, "free_bytes": 42 * GIB, "kv_bytes": 30 * GIB}]}


@SETTINGS
@given(BAD_NAME)
def test_store_host_class(tmp_path, name):
    store = ProfileStore(str(tmp_path / "store"))
    refused(lambda: store.record({"host_class": name, "compat": {"model": "m"}, "profile": PROFILE}),
            (ProfileStoreError,), "host_class")
    refused(lambda: store.query(name, {"model": "m"}), (ProfileStoreError,), "host_class")
    outside = [p for p in os.listdir(tmp_path) if p != "store"]
    COUNTS["outside"] += len(outside)
    assert not outside


@SETTINGS
@given(st.one_of(
    st.tuples(st.just("ranks"), st.sampled_from([[], None, "x", [{"rank": 0}], [1]])),
    st.tuples(st.just("free_bytes"), st.sampled_from([math.inf, math.nan]))))
def test_store_profile(tmp_path, bad):
    key, value = bad
    profile = {"ranks": value} if key == "ranks" else {"ranks": PROFILE["ranks"], "note": value}
    store = ProfileStore(str(tmp_path / "store"))
    field = "profile"
    refused(lambda: store.record({"host_class": "c", "compat": {"model": "m"}, "profile": profile}),
            (ProfileStoreError,), field)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300))
def test_store_reports_every_garbage_file_and_keeps_the_good_one(tmp_path, data):
    store = ProfileStore(str(tmp_path / "store"))
    if not os.path.exists(tmp_path / "store" / "c"):
        store.record({"host_class": "c", "compat": {"model": "m"}, "profile": PROFILE})
    bad = tmp_path / "store" / "c" / "c--0000000000000000--20991231T000000000000Z--deadbeef.yml"
    bad.write_bytes(data)
    COUNTS["tried"] += 1
    try:
        answer = store.query("c", {"model": "m"})
    except Exception:
        COUNTS["tracebacks"] += 1
        raise
    assert answer["status"] == "found" and answer["profile"]["path"] != str(bad)
    if [c for c in answer["corrupt"] if c["path"] == str(bad)]:
        COUNTS["clear"] += 1
    else:
        COUNTS["silent"] += 1
        raise AssertionError(f"garbage accepted as a profile: {data!r}")


def test_zz_counts(capsys):
    """Printed with ``pytest -s``; the goals: no traceback, no silent acceptance, nothing written outside."""
    with capsys.disabled():
        print(f"\nbad inputs tried {COUNTS['tried']}, clear errors {COUNTS['clear']}, tracebacks {COUNTS['tracebacks']}, "
              f"silent {COUNTS['silent']}, unclear {COUNTS['unclear']}, files outside {COUNTS['outside']}")
    assert COUNTS["tried"] > 0
    assert COUNTS["tracebacks"] == COUNTS["silent"] == COUNTS["unclear"] == COUNTS["outside"] == 0
    assert COUNTS["clear"] == COUNTS["tried"]


def test_parse_size_is_fast_on_huge_exponents():
    import time  # pylint: disable=import-outside-toplevel

    start = time.process_time()
    for text in ("1e999999", "1e-999999", "9" * 60 + "e30", "1" * 64):
        with pytest.raises(SizeError):
            parse_size(text)
    assert time.process_time() - start < 1.0
