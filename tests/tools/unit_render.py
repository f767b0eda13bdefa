# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Render vllm_service units and environment files with the real ansible-playbook.

``render(cases, out)`` runs one playbook on localhost that, for each case (a dict of
role variables with ``vllm_service_instance``), loads the role defaults, renders the unit
and the secret environment file as the role does (tasks/render.yml), and writes them to
``out/<case>.service`` and ``out/<case>.env``; it also runs the role's validate tasks. A step that fails writes ``out/<case>.<step>.error``
(``validate``, ``template``, ``render``) with the failure message instead. Used by the unit tests (quoting,
refusals, ``systemd-analyze verify``) and the integration test that hands the units to
systemd in a test host.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any, Mapping

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "vllm_service"


def _playbook_bin() -> str:
    local = pathlib.Path(sys.executable).parent / "ansible-playbook"
    return str(local) if local.exists() else (shutil.which("ansible-playbook") or "ansible-playbook")


def render(cases: Mapping[str, Mapping[str, Any]], out: pathlib.Path) -> dict[str, dict[str, str]]:
    """``{case: {unit, env, template_unit, template_env, validate_error, template_error, render_error}}`` (those that exist)."""
    out.mkdir(parents=True, exist_ok=True)
    tasks: list[dict[str, Any]] = [
        {"name": "Load the role defaults", "ansible.builtin.include_vars": str(ROLE / "defaults" / "main.yml")},
        {"name": "Load the role's internal variables", "ansible.builtin.include_vars": str(ROLE / "vars" / "main.yml")}]
    for case, facts in cases.items():
        one = {"vllm_service_instances": [facts["vllm_service_instance"]]}
        tasks.append({"name": f"Facts {case}", "ansible.builtin.set_fact": dict(facts)})
        tasks.append(_kept(case, "validate", [
            {"name": f"Validate {case}",
             "ansible.builtin.include_role": {"name": "gpufleet.vllm.vllm_service", "tasks_from": "validate"},
             "vars": one}]))
        tasks.append(_kept(case, "render", [
            {"name": f"Render {case}",
             "ansible.builtin.include_role": {"name": "gpufleet.vllm.vllm_service", "tasks_from": "render"},
             "vars": one},
            {"name": f"Write the unit of {case}",
             "ansible.builtin.copy": {"content": "{{ vllm_service_rendered[0].unit }}",
                                      "dest": str(out / f"{case}.service"), "mode": "0644"}},
            {"name": f"Write the environment file of {case}",
             "ansible.builtin.copy": {"content": "{{ vllm_service_rendered_env[vllm_service_instance.name] }}",
                                      "dest": str(out / f"{case}.env"), "mode": "0600"}}]))
    _run(tasks, out)
    result: dict[str, dict[str, str]] = {}
    for case in cases:
        found: dict[str, str] = {}
        for key, name in (("unit", f"{case}.service"), ("env", f"{case}.env"),
                          ("template_unit", f"{case}.template.service"), ("template_env", f"{case}.template.env"),
                          ("validate_error", f"{case}.validate.error"), ("template_error", f"{case}.template.error"),
                          ("render_error", f"{case}.render.error")):
            if (out / name).exists():
                found[key] = (out / name).read_text()
        result[case] = found
    return result


def template_errors(cases: Mapping[str, Mapping[str, Any]], out: pathlib.Path) -> dict[str, str | None]:
    """Render the unit and environment templates of each case with the template module, in one looped
    task each; ``{case: the failure messages, or None when both templates rendered}``."""
    import yaml  # pylint: disable=import-outside-toplevel

    out.mkdir(parents=True, exist_ok=True)
    # task vars rank below include_vars, so the defaults are merged here, not loaded in the play
    items = [{k: v for k, v in dict(role_vars(facts), unit_render_case=case).items()
              if "{{" not in json.dumps(v)} for case, facts in cases.items()]
    keys = sorted({k for item in items for k in item})
    per_item = {k: "{{ item['" + k + "'] }}" for k in keys}
    # the role's internal launch record, worked out from each item's variables as the role does
    role_internal = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    per_item["__vllm_service_launch"] = role_internal["__vllm_service_launch"]
    per_item["__vllm_service_plan_file_facts"] = role_internal["__vllm_service_plan_file_facts"]
    tasks: list[dict[str, Any]] = []
    for kind, template in (("unit", "vllm.service.j2"), ("env", "vllm.env.j2")):
        # debug on the controller: no module runs per item, only the template engine
        tasks.append({"name": f"Template the {kind} of each case", "ansible.builtin.debug": {
            "msg": "{{ lookup('ansible.builtin.template', '" + str(ROLE / "templates" / template) + "') | length }}"},
            "vars": per_item, "loop": items, "register": f"unit_render_{kind}",
            "failed_when": False, "loop_control": {"label": "{{ item.unit_render_case }}"}})
    tasks.append({"name": "Write the outcome", "ansible.builtin.copy": {
        "dest": str(out / "template-errors.json"), "mode": "0644",
        "content": "{{ (unit_render_unit.results + unit_render_env.results) | map(attribute='item.unit_render_case') | list"
                   " | zip((unit_render_unit.results + unit_render_env.results)"
                   " | map(attribute='failed', default=false) | list,"
                   " (unit_render_unit.results + unit_render_env.results) | map(attribute='msg', default='') | list)"
                   " | list | to_json }}"}})
    _run(tasks, out)
    pairs = json.loads((out / "template-errors.json").read_text())
    errors: dict[str, list[str]] = {case: [] for case in cases}
    for case, failed, msg in pairs:
        errors[case].append(str(msg) if failed else "")
    return {case: "; ".join(m for m in msgs if m) or None for case, msgs in errors.items()}


def _run(tasks: list[dict[str, Any]], out: pathlib.Path) -> None:
    play = [{"hosts": "localhost", "connection": "local", "gather_facts": False, "tasks": tasks}]
    playbook = out / "render.yml"
    playbook.write_text(json.dumps(play))
    collections = out / "collections"
    if not collections.exists():
        (collections / "ansible_collections" / "gpufleet").mkdir(parents=True)
        os.symlink(ROOT, collections / "ansible_collections" / "gpufleet" / "vllm")
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0")
    argv = [_playbook_bin(), "-i", "localhost,", "-e", f"ansible_python_interpreter={sys.executable}",
            "-e", json.dumps({"unit_render_out": str(out)}), str(playbook)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    if proc.returncode != 0:
        raise AssertionError(proc.stdout[-4000:] + proc.stderr[-2000:])


def _kept(case: str, step: str, block: list[dict[str, Any]]) -> dict[str, Any]:
    """``block`` whose failure message is written to ``<case>.<step>.error`` instead of failing the play."""
    return {"name": f"{step} {case}", "block": block,
            "rescue": [{"name": f"Keep the failure of {step} {case}",
                        "ansible.builtin.copy": {"content": "{{ ansible_failed_result.msg | default('failed') }}",
                                                 "dest": "{{ unit_render_out }}/" + f"{case}.{step}.error",
                                                 "mode": "0644"}}]}


# ---------------------------------------------------------------- shared cases

PLAN_MANUAL = {"decision": "deploy", "kv_cache_memory_bytes": 30333206528, "gpu_memory_utilization": 0.2854,
               "free_floor_bytes": {"0": 43754979328}, "kv_cache_tokens": 231424, "num_blocks": 14464}

# Legal values that a naive quoting gets wrong: spaces, both quotes, $ and ${}, systemd
# specifiers (%h, %%), backslashes, shell metacharacters, a leading '#', non-ASCII.
AWKWARD = "a b \"dq\" 'sq' $HOME ${USER} %h %% \\back\\slash ;&|`echo x` #not é 模型 \\"
HOSTILE_MODEL = "/srv/models/llama 3 " + AWKWARD
HOSTILE_SERVED = ["a b", "$x ${y}", "%n %%", "semi;colon", "back\\", "quote\"", "'", "", "é"]
# legal systemd unit names, a template instance with systemd's escapes among them
HOSTILE_AFTER_UNITS = ["nvidia-persistenced.service", "nvidia-fabricmanager.service", "gpu-ready@dev-nvidia\\x2d0.target"]
HOSTILE_ENV = {"NOTE": "50% " + AWKWARD, "EMPTY": "", "HASH": "#x", "SPACES": "  lead and trail  "}
HOSTILE_SECRET_ENV = {"VLLM_API_KEY": "k$ey\"q\\b`t` %h 'x' ; é \\", "HF_TOKEN": "#not-a-comment",
                      "SPACED": "  two  words  "}


def role_vars(case: Mapping[str, Any]) -> dict[str, Any]:
    """The role's defaults overlaid with a case, as the role's validate tasks see them."""
    import yaml  # pylint: disable=import-outside-toplevel

    data = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    data.update(yaml.safe_load((ROLE / "vars" / "main.yml").read_text()))
    data.update(case)
    data["vllm_service_instances"] = [case["vllm_service_instance"]]
    # the defaults that are templates (vllm_service_boot_gate_python, vllm_service_health_host, ...)
    # reach the validate tasks rendered
    from ansible.parsing.dataloader import DataLoader  # pylint: disable=import-outside-toplevel
    from ansible.template import Templar  # pylint: disable=import-outside-toplevel

    try:
        from ansible.template import trust_as_template  # pylint: disable=import-outside-toplevel
    except ImportError:  # ansible-core before 2.19 templates every string
        def trust_as_template(value: str) -> str:
            return value

    data = {k: trust_as_template(v) if isinstance(v, str) and "{{" in v else v for k, v in data.items()}
    templar = Templar(loader=DataLoader(), variables=data)
    return {k: templar.template(v) if k.startswith("vllm_service_") and isinstance(v, str) and "{{" in v else v
            for k, v in data.items()}


def hostile_case(executable: str, name: str = "q", port: int = 8000, gpus: list[int] | None = None,
                 home: str = "/var/lib/vllm", user: str = "vllm", group: str = "vllm") -> dict[str, Any]:
    """Role variables full of legal but awkward values; systemd must read each one exactly."""
    return {
        "vllm_service_instance": {"name": name, "gpus": gpus or [0], "port": port},
        "vllm_service_plan": PLAN_MANUAL,
        "vllm_service_executable": executable,
        # a manual budget starts through the boot gate: the same program records the gate's words
        "vllm_service_boot_gate_bin": executable,
        "vllm_service_model": HOSTILE_MODEL,
        "vllm_service_serve_args": {"served_model_name": HOSTILE_SERVED, "max_model_len": 4096,
                                    "chat_template": AWKWARD, "enable_prefix_caching": False},
        "vllm_service_env": HOSTILE_ENV,
        "vllm_service_secret_env": HOSTILE_SECRET_ENV,
        "vllm_service_host_class": "h200.x_1-a",
        "vllm_service_after_units": list(HOSTILE_AFTER_UNITS),
        "vllm_service_home": home,
        "vllm_service_user": user,
        "vllm_service_group": group,
    }


def expected_words(case: Mapping[str, Any]) -> list[str]:
    """The argv (after the executable) the unit of ``hostile_case`` must start the program with:
    the boot gate's words, then ``--``, the engine's executable and its words."""
    plan = case["vllm_service_plan"]
    serve = case["vllm_service_serve_args"]
    name = case["vllm_service_instance"]["name"]
    gate = ["--plan", f"/etc/gpufleet/{name}.plan.json", "--policy", "shrink",
            "--state", f"/var/lib/gpufleet-vllm/{name}.boot-gate.json", "--", case["vllm_service_executable"]]
    engine = ["serve", case["vllm_service_model"], "--host", "0.0.0.0", "--port", str(case["vllm_service_instance"]["port"]),
              "--kv-cache-memory-bytes", str(plan["kv_cache_memory_bytes"]),
              "--gpu-memory-utilization", str(plan["gpu_memory_utilization"]),
              "--chat-template", serve["chat_template"], "--no-enable-prefix-caching",
              "--max-model-len", str(serve["max_model_len"]), "--served-model-name", *serve["served_model_name"]]
    return gate + engine


# A value with a newline (or another control character) in every place that reaches the
# unit: the case name, the role variables to change, and the variable the error must name.
INJECTION = "x\nExecStartPre=+/bin/touch /tmp/pwned"


def injections() -> list[tuple[str, dict[str, Any], str]]:
    inst = {"name": "q", "gpus": [0], "port": 8000}
    return [
        ("env_name", {"vllm_service_env": {"A\nExecStartPre": "1"}}, "vllm_service_env name"),
        ("env_value", {"vllm_service_env": {"NOTE": INJECTION}}, "vllm_service_env.NOTE"),
        ("serve_key", {"vllm_service_serve_args": {"max_model_len\nExecStartPre": 1}}, "serve_args option name"),
        ("serve_value", {"vllm_service_serve_args": {"chat_template": INJECTION}}, "serve_args.chat_template"),
        ("serve_item", {"vllm_service_serve_args": {"served_model_name": ["a", INJECTION]}}, "serve_args.served_model_name"),
        ("serve_option_value", {"vllm_service_serve_args": {"served_model_name": ["--api-key", "x"]}},
         "serve_args.served_model_name: a value must not start with '--'"),
        ("model", {"vllm_service_model": INJECTION}, "vllm_service_model"),
        ("model_trailing_newline", {"vllm_service_model": "/srv/models/m\n"}, "vllm_service_model"),
        ("host_class", {"vllm_service_host_class": "h200\nExecStartPre=+/bin/sh"}, "vllm_service_host_class"),
        ("user", {"vllm_service_user": "vllm\nExecStartPre=+/bin/sh"}, "vllm_service_user"),
        ("group", {"vllm_service_group": "vllm\n"}, "vllm_service_group"),
        ("home", {"vllm_service_home": "/var/lib/vllm\nExecStartPre=+/bin/sh"}, "vllm_service_home"),
        ("gpus", {"vllm_service_instance": dict(inst, gpus=["0\nExecStartPre=+/bin/sh"])}, "gpus"),
        ("instance_name", {"vllm_service_instance": dict(inst, name="q\nx")}, "name"),
        ("secret_name", {"vllm_service_secret_env": {"A\nB": "x"}}, "vllm_service_secret_env name"),
        ("secret_value", {"vllm_service_secret_env": {"HF_TOKEN": "t\nLD_PRELOAD=/tmp/x.so"}},
         "vllm_service_secret_env.HF_TOKEN"),
        ("listen_host", {"vllm_service_listen_host": "0.0.0.0\nExecStartPre=+/bin/sh"}, "vllm_service_listen_host"),
        ("device_allow", {"vllm_service_device_allow": ["char-nvidia* rw\nExecStartPre=+/bin/sh"]},
         "vllm_service_device_allow"),
    ]
