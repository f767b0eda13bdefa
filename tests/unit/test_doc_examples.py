# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""ansible-doc reads every module, action doc stub and filter of the collection, and their
EXAMPLES work as written.

The examples are taken from ansible-doc's output (what a user reads) and run with
ansible-playbook: the filters' examples as play variables, each checked against the
result documented above it (``# => <value>``); the examples of the controller-side
modules (kv_profile, kv_plan, rollout_bake, rollout_lease, rollout_report) on localhost with the inputs they name
(rollout_bake's against engines served over HTTP here, in vLLM's exposition format).
The examples that need a GPU host run in tests/integration/test_doc_examples_hosts.py.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "examples"))

import doc_examples  # noqa: E402  pylint: disable=wrong-import-position,import-error

MODULES = sorted(p.stem for p in (REPO / "plugins" / "modules").glob("*.py") if not p.name.startswith("_"))
FILTERS = sorted(p.stem for p in (REPO / "plugins" / "filter").glob("*.yml"))
# Modules whose examples run here (controller side); the others need a GPU host.
CONTROLLER_MODULES = ["class_plan", "kv_plan", "kv_profile", "rollout_bake", "rollout_lease", "rollout_report"]
HOST_MODULES = ["gpu_memory_facts", "gpu_memory_info", "nvml_interpreter", "vllm_account", "vllm_audit", "vllm_boot_check", "vllm_canary",
                "vllm_host_snapshot", "vllm_host_tools", "vllm_runtime_info", "vllm_unit"]
MODEL_CONFIG = REPO / "sim" / "models" / "llama-3.1-8b-instruct" / "config.json"
GIB = 1024**3


@pytest.fixture(scope="module")
def collections_path():
    """A collections tree holding this checkout as gpufleet.vllm."""
    tree = Path(tempfile.mkdtemp(prefix="ansible-doc-"))
    yield doc_examples.make_collections_tree(tree)
    shutil.rmtree(tree, ignore_errors=True)


def test_plugins_found():
    assert "rollout_report" in MODULES and "kv_plan" in MODULES and "gpu_memory_info" in MODULES and "gpu_memory_facts" in MODULES
    assert FILTERS == ["boot_timeout", "class_canary", "class_canary_hosts", "class_deploy_order", "class_rollback_hosts",
                       "class_settings_problems", "class_state",
                       "class_states", "compat_fields", "cuda_visible_devices", "failure_message", "first_run_outline", "gang_addresses",
                       "gang_api_instances", "gang_batches", "gang_key_fields", "gang_member_launch", "gang_members", "gang_problems", "gang_stragglers",
                       "gangs", "gate_violations", "health_url", "host_pattern", "host_plan", "human_bytes", "kv_bytes_per_token", "kv_reference",
                       "launch_contract", "launch_plan_file", "launch_runs", "launch_serve_args", "metrics_targets", "release_history",
                       "rollback_summary", "rollout_batches",
                       "rollout_plan", "rollout_plan_drift", "run_settings", "runtime_problems", "systemd_environment",
                       "systemd_environment_file", "systemd_exec_start", "systemd_value", "to_bytes", "unit_name",
                       "unknown_variables", "vllm_instances_problems", "vllm_secret_options", "vllm_serve_argv", "vllm_service_problems"]
    assert sorted(CONTROLLER_MODULES + HOST_MODULES) == MODULES, "every module's examples run in one of the two tests"


def test_module_docs_and_examples(collections_path):
    docs = doc_examples.ansible_doc(collections_path, "module", MODULES)
    assert sorted(docs) == [f"gpufleet.vllm.{n}" for n in MODULES]
    problems = []
    for name, entry in sorted(docs.items()):
        doc = entry["doc"]
        if not doc.get("short_description") or doc.get("options") is None:
            problems.append(f"{name}: no short_description/options")
        if not entry.get("return"):
            problems.append(f"{name}: no RETURN")
        tasks = yaml.safe_load(entry.get("examples") or "")
        if not isinstance(tasks, list) or not tasks:
            problems.append(f"{name}: EXAMPLES is not a YAML list of tasks")
            continue
        if not all(isinstance(t, dict) and t.get("name") for t in tasks):
            problems.append(f"{name}: every example task needs a name")
        used = [t for t in tasks if isinstance(t, dict) and name in t]
        if not used:
            problems.append(f"{name}: no example task uses {name}")
        for task in used:
            args = task[name] or {}
            unknown = sorted(set(args) - set(doc["options"])) if isinstance(args, dict) else []
            if unknown:
                problems.append(f"{name}: example uses unknown options {unknown}")
    assert not problems, "\n".join(problems)


def test_filter_docs_and_examples(collections_path):
    docs = doc_examples.ansible_doc(collections_path, "filter", FILTERS)
    assert sorted(docs) == [f"gpufleet.vllm.{n}" for n in FILTERS]
    for name, entry in docs.items():
        examples = entry.get("examples") or ""
        assert examples.strip(), f"{name}: no EXAMPLES"
        cases = doc_examples.filter_cases(examples)  # every variable documents its result
        assert all(name in case.template for case in cases), f"{name}: an example does not use the filter"


def test_filter_examples_return_what_they_document(collections_path, tmp_path):
    texts = doc_examples.examples(collections_path, "filter", FILTERS)
    # The inputs the examples name: the inventory's guard and the model's config.json.
    inputs = {"gpufleet_guard": "0.5GiB", "gpufleet_model_config": str(MODEL_CONFIG)}
    cases = {name: doc_examples.filter_cases(texts[name]) for name in FILTERS}
    out = tmp_path / "results.json"
    proc = doc_examples.run_playbook(doc_examples.filter_playbook(cases, inputs, out), tmp_path, collections_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    results = json.loads(out.read_text(encoding="utf-8"))
    problems = []
    for name in FILTERS:
        got = results[name]
        for case in cases[name]:
            if case.error is not None:
                error = got["errors"].get(case.key)
                if error is None or case.error not in error:
                    problems.append(f"{name} {case.key}: documented error {case.error!r}, got {error or got['results'].get(case.key)!r}")
            elif case.key in got["errors"]:
                problems.append(f"{name} {case.key}: failed: {got['errors'][case.key]}")
            elif got["results"].get(case.key) != case.expected:
                problems.append(f"{name} {case.key}: documented {case.expected!r}, got {got['results'].get(case.key)!r}")
    assert not problems, "\n".join(problems)


def _queried_key(kv_profile_examples: str) -> dict:
    """The compatibility key kv_profile's query example looks up (the examples after it use the same one)."""
    query = next(t for t in doc_examples.example_tasks(kv_profile_examples)
                 if t.get("gpufleet.vllm.kv_profile", {}).get("state", "query") == "query")
    return query["gpufleet.vllm.kv_profile"]["compat"]


def test_profile_and_plan_examples_run_in_sequence(collections_path, tmp_path):
    """kv_profile's examples record a profile and find it; kv_plan's examples plan from it."""
    texts = doc_examples.examples(collections_path, "module", ["kv_profile", "kv_plan"])
    compat = _queried_key(texts["kv_profile"])
    store = tmp_path / "profiles"
    out = tmp_path / "results.json"

    def gpus(free_gib):
        return [{"index": 0, "name": "NVIDIA H200", "total_bytes": 150754820096, "boot_free_bytes": int(free_gib * GIB),
                 "free_bytes": int(free_gib * GIB), "free_min_bytes": int(free_gib * GIB), "free_max_bytes": int(free_gib * GIB)}]

    # The class group kv_plan reads (hosts_from), with the facts gpu_memory_facts leaves on each host.
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {
        "hosts": {"localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}},
        "children": {"h200_llama8b": {"hosts": {"gpu-a1": {"gpufleet_gpus": gpus(41.75)}, "gpu-a2": {"gpufleet_gpus": gpus(42)}}}},
    }}), encoding="utf-8")
    playbook = doc_examples.module_playbook(
        texts["kv_profile"], "localhost", {"gpufleet_profile_store": str(store), "gpufleet_compat": compat}, connection="local")
    playbook += doc_examples.module_playbook(texts["kv_plan"], "localhost", connection="local", post_tasks=[{
        "name": "Keep the results",
        "ansible.builtin.copy": {
            "dest": str(out), "mode": "0644",
            "content": "{{ {'reference': gpufleet_reference, 'plan': gpufleet_plan, 'seed': seed_plan, 'fit': gpufleet_fit_plan} | to_json }}",
        },
    }])
    proc = doc_examples.run_playbook(playbook, tmp_path, collections_path, inventory=inventory)
    doc_examples.assert_examples_ran(proc, texts["kv_profile"])
    doc_examples.assert_examples_ran(proc, texts["kv_plan"])
    got = json.loads(out.read_text(encoding="utf-8"))
    assert got["reference"]["status"] == "found" and len(list(store.glob("h200-llama8b/*"))) == 1
    # 30 GiB at 42 GiB free in the profile; weakest host 41.75 GiB free: 30 - 0.5 - 0.25 GiB = 29.25 GiB max safe,
    # less the default gate margin (768 MiB): 28.5 GiB, whole 256 MiB granules
    assert got["plan"]["decision"] == "deploy" and got["plan"]["kv_cache_memory_bytes"] == int(29.25 * GIB) - 768 * 1024**2
    assert got["plan"]["weakest"]["host"] == "gpu-a1/vllm" and got["plan"]["admission"]["ok"] is True
    assert got["seed"]["kv_cache_memory_bytes"] == int(28.25 * GIB), "the seed example's name says 28.25 GiB"
    assert got["fit"]["budget_mode"] == "fit_admission" and got["fit"]["admission"]["ok"] is True
    assert 16 * 8192 <= got["fit"]["kv_cache_tokens"] < got["plan"]["kv_cache_tokens"]


def test_class_plan_examples_find_the_reference_kv_profile_recorded(collections_path, tmp_path):
    """kv_profile's examples record a profile; class_plan's examples find it for the same key and outline the class."""
    texts = doc_examples.examples(collections_path, "module", ["kv_profile", "class_plan"])
    compat = _queried_key(texts["kv_profile"])
    store = tmp_path / "profiles"
    out = tmp_path / "results.json"

    def snapshot(state):
        return {"gpus": [{"index": 0, "boot_free_bytes": 42 * GIB}],
                "instances": [{"name": "main", "active_state": state, "unit_exists": state != "inactive", "plan": {}}]}

    inventory = tmp_path / "inventory.yml"
    members = {"gpu-a1": {"gpufleet_snapshot": snapshot("active")}, "gpu-a2": {"gpufleet_snapshot": snapshot("inactive")}}
    inventory.write_text(yaml.safe_dump({"all": {
        "hosts": {"localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}},
        "children": {"h200_llama8b": {"hosts": members}},
    }}), encoding="utf-8")
    variables = {"gpufleet_profile_store": str(store), "gpufleet_compat": compat}
    playbook = doc_examples.module_playbook(texts["kv_profile"], "localhost", variables, connection="local")
    playbook += doc_examples.module_playbook(texts["class_plan"], "localhost", variables, connection="local", post_tasks=[{
        "name": "Keep the result", "ansible.builtin.copy": {"dest": str(out), "mode": "0644", "content": "{{ class_plan | to_json }}"}}])
    proc = doc_examples.run_playbook(playbook, tmp_path, collections_path, inventory=inventory)
    doc_examples.assert_examples_ran(proc, texts["class_plan"])
    got = json.loads(out.read_text(encoding="utf-8"))
    recorded = list(store.glob("h200-llama8b/*.yml"))
    assert got["reference"]["status"] == "found" and got["reference"]["profile"]["path"] == str(recorded[0])
    assert got["canary"] == {"reference_found": True, "profiled": False, "why": "", "plan_now": True, "dry_run_stop": ""}
    assert got["plan_moved"] == [] and got["key_hash"] == got["reference"]["profile"]["key_hash"]
    spec = got["first_run_spec"]
    assert spec["batches"] == [["gpu-a1"], ["gpu-a2"]] and spec["hosts"]["gpu-a2"][0]["active_state"] == "inactive"
    assert spec["manual_canary"] is None and spec["boot_source"] == "the reference profile's canary"


def test_rollout_lease_examples_take_and_release_the_lease(collections_path, tmp_path):
    text = doc_examples.examples(collections_path, "module", ["rollout_lease"])["rollout_lease"]
    store = tmp_path / "profiles"
    state_dir = tmp_path / "state"
    out = tmp_path / "results.json"
    keep = {"name": "Keep the results", "ansible.builtin.copy": {"dest": str(out), "mode": "0644",
                                                                 "content": "{{ {'classes': lease, 'host': host_lease} | to_json }}"}}
    playbook = doc_examples.module_playbook(text, "localhost", {"gpufleet_profile_store": str(store), "gpufleet_run_id": "run-1",
                                                                "vllm_service_state_dir": str(state_dir)},
                                            connection="local", post_tasks=[keep])
    proc = doc_examples.run_playbook(playbook, tmp_path, collections_path)
    doc_examples.assert_examples_ran(proc, text)
    got = json.loads(out.read_text(encoding="utf-8"))
    assert [lease["scope"] for lease in got["classes"]["leases"]] == ["h200-tp1", "l40s"] and got["classes"]["taken_over"] == []
    assert all(lease["run_id"] == "run-1" for lease in got["classes"]["leases"])
    host = got["host"]["leases"]
    assert [(lease["scope"], lease["run_id"], lease["host_class"]) for lease in host] == [("host", "run-1", "h200-tp1")]
    # the module ran the host's lease, naming the controller process that took it (ansible-playbook, alive)
    assert isinstance(host[0]["pid"], int) and host[0]["pid_start"] and host[0]["owner"]
    assert not list((store / ".leases").glob("*.json")), "the last example released both class leases"
    assert not list((state_dir / ".leases").glob("*.json")), "the host's lease was released"


def test_rollout_report_examples_write_their_reports(collections_path, tmp_path):
    text = doc_examples.examples(collections_path, "module", ["rollout_report"])["rollout_report"]
    reports = tmp_path / "reports"
    reports.mkdir()  # the option says it must exist (the playbooks create it up front)
    out = tmp_path / "results.json"
    playbook = doc_examples.module_playbook(text, "localhost", {"gpufleet_report_dir": str(reports)}, connection="local", post_tasks=[{
        "name": "Keep the results",
        "ansible.builtin.copy": {"dest": str(out), "mode": "0644", "content": "{{ {'rollout': report, 'probe': probe_report} | to_json }}"},
    }])
    proc = doc_examples.run_playbook(playbook, tmp_path, collections_path)
    doc_examples.assert_examples_ran(proc, text)
    got = json.loads(out.read_text(encoding="utf-8"))
    assert f"-> {got['rollout']['path']}/report.html" in proc.stdout
    assert sorted(p.name.split("-")[0] for p in reports.iterdir()) == ["probe", "rollout"]
    assert got["rollout"]["summary"] == "rollout: 1 class(es), 1 deployable; 1 deployed"
    assert got["probe"]["failed_hosts"] == ["gpu-b"]
    assert got["probe"]["summary"].startswith("probe: 1 of 2 host(s) probed, 1 GPU(s), 1 of 1 instance(s) active")
    for kind in ("rollout", "probe"):
        run = Path(got[kind]["path"])
        assert sorted(p.name for p in run.iterdir()) == ["report.html", "report.json", "report.md"]
        assert json.loads((run / "report.json").read_text(encoding="utf-8"))["kind"] == kind


class _Engine(ThreadingHTTPServer):
    """An engine's /metrics in vLLM's exposition format: each read finds 10 more finished requests, each with
    ``itl`` seconds per output token (the bake reads every engine twice)."""

    def __init__(self, itl: float) -> None:
        self.itl, self.reads = itl, 0
        super().__init__(("127.0.0.1", 0), _MetricsHandler)

    def text(self) -> str:
        self.reads += 1
        n, labels = 10.0 * self.reads, 'engine="0",model_name="tiny"'
        lines = ["# TYPE vllm:request_success_total counter", f'vllm:request_success_total{{{labels},finished_reason="stop"}} {n}',
                 "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{labels}}} 0.25"]
        for name, value in (("vllm:inter_token_latency_seconds", self.itl), ("vllm:time_to_first_token_seconds", 0.05)):
            lines.append(f"# TYPE {name} histogram")
            for le in (0.01, 0.025, 0.05, 0.1, 0.25, 0.5):
                lines.append(f'{name}_bucket{{{labels},le="{le}"}} {n if value <= le else 0.0}')
            lines += [f'{name}_bucket{{{labels},le="+Inf"}} {n}', f"{name}_count{{{labels}}} {n}", f"{name}_sum{{{labels}}} {n * value}"]
        return "\n".join(lines) + "\n"


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802  (the http.server API)
        assert isinstance(self.server, _Engine)
        body = self.server.text().encode() if self.path == "/metrics" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("canary_itl", [0.02, 0.2])
def test_rollout_bake_examples_judge_the_batch_against_the_baseline(collections_path, tmp_path, canary_itl):
    """The bake reads a changed host's and an unchanged host's engines over HTTP, twice, and judges: alike, the
    examples pass; ten times slower per output token, the verdict fails on itl_p90 and the example's check stops."""
    text = doc_examples.examples(collections_path, "module", ["rollout_bake"])["rollout_bake"]
    engines = {"gpu-01": _Engine(canary_itl), "gpu-02": _Engine(0.02)}
    threads = [threading.Thread(target=e.serve_forever, daemon=True) for e in engines.values()]
    for thread in threads:
        thread.start()
    try:
        hosts = {name: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                        "gpufleet_metrics_targets": [{"host": name, "instance": "main",
                                                      "url": f"http://127.0.0.1:{e.server_address[1]}/metrics"}]}
                 for name, e in engines.items()}
        inventory = tmp_path / "inventory.yml"
        inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}), encoding="utf-8")
        out = tmp_path / "bake.json"
        variables = {"changed_hosts": ["gpu-01"], "unchanged_hosts": ["gpu-02"], "gpufleet_bake_seconds": 1}
        keep = {"name": "Keep the bake", "run_once": True,
                "ansible.builtin.copy": {"dest": str(out), "mode": "0644", "content": "{{ bake | to_json }}"}}
        playbook = doc_examples.module_playbook(text, "all", variables, pre_tasks=[], post_tasks=[keep])
        # the verdict is kept before the example's check can stop the play
        playbook[0]["tasks"].insert(1, keep)
        proc = doc_examples.run_playbook(playbook, tmp_path, collections_path, inventory=inventory)
    finally:
        for e in engines.values():
            e.shutdown()
            e.server_close()
    bake = json.loads(out.read_text(encoding="utf-8"))
    checks = {c["name"]: c for c in bake["analysis"]["checks"]}
    assert all(e.reads == 2 for e in engines.values()), "every engine is read at the start and the end of the bake"
    assert bake["canary_hosts"] == ["gpu-01"] and bake["baseline_hosts"] == ["gpu-02"]
    assert checks["success_rate"]["verdict"] == "pass" and checks["success_rate"]["samples"] == {"canary": 10.0, "baseline": 10.0}
    assert checks["ttft_p90"]["verdict"] == "pass" and "e2e_p90" not in checks and "preemptions" not in checks
    if canary_itl < 0.1:
        doc_examples.assert_examples_ran(proc, text)
        assert bake["analysis"]["verdict"] == "pass" and checks["itl_p90"]["verdict"] == "pass", bake["msg"]
    else:
        assert proc.returncode != 0
        assert bake["analysis"]["verdict"] == "fail" and checks["itl_p90"]["verdict"] == "fail", bake["msg"]
        assert "itl_p90 fail:" in bake["msg"] and "(above 1.3)" in bake["msg"]
        assert "Stop when the batch does worse than the baseline" in proc.stdout and bake["msg"] in proc.stdout


def test_rollout_bake_fails_on_an_engine_of_the_batch_it_cannot_read(collections_path, tmp_path):
    """A changed host whose engine does not answer is a failed analysis naming its URL, without waiting the bake."""
    playbook = [{"name": "Bake", "hosts": "localhost", "gather_facts": False, "connection": "local", "tasks": [
        {"name": "Bake a batch whose engine is down", "register": "bake", "gpufleet.vllm.rollout_bake": {
            "seconds": 600, "timeout": 2, "canary": [{"host": "gpu-01", "instance": "main", "url": "http://127.0.0.1:9/metrics"}]}},
        {"name": "Show", "ansible.builtin.debug": {"msg": "VERDICT {{ bake.analysis.verdict }} {{ bake.msg }}"}},
        {"name": "Refuse bad settings", "register": "bad", "ignore_errors": True, "gpufleet.vllm.rollout_bake": {
            "seconds": 1, "checks": {"itl_p90": {"max_ratio": 0.5}},
            "canary": [{"host": "gpu-01", "instance": "main", "url": "http://127.0.0.1:9/metrics"}]}},
        {"name": "Show the refusal", "ansible.builtin.debug": {"msg": "REFUSED {{ bad.msg }}"}},
    ]}]
    proc = doc_examples.run_playbook(playbook, tmp_path, collections_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "VERDICT fail the bake could not read the batch's engines: http://127.0.0.1:9/metrics:" in proc.stdout
    assert "REFUSED rollout_bake checks.itl_p90.max_ratio: expected a number of at least 1, got 0.5" in proc.stdout
