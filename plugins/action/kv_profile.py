# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin for gpufleet.vllm.kv_profile: read, build or record reference profiles on the controller."""

from __future__ import annotations

import os
from typing import Any, Mapping

from ansible.errors import AnsibleActionFail, AnsibleError
from ansible.plugins.action import ActionBase

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._compat import CompatError, compat_key, key_hash
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._canary_reference import (
    ReferenceError,
    model_config_from,
    reference_from_canary,
)
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._profile_store import ProfileStore, ProfileStoreError

ARGUMENT_SPEC: dict[str, Any] = {
    "store": {"type": "path"},
    "state": {"type": "str", "default": "query", "choices": ["query", "present", "latest", "build"]},
    "host_class": {"type": "str"},
    "compat": {"type": "dict"},
    "profile": {"type": "dict"},
    "canary": {
        "type": "dict",
        "options": {
            "result": {"type": "dict", "required": True},
            "preboot_gpus": {"type": "list", "elements": "dict", "required": True},
            "gpus": {"type": "list", "elements": "int", "required": True},
            "model_config": {"type": "raw"},
            "model_config_file": {"type": "dict"},
            "serve_args": {"type": "dict"},
            "facts": {"type": "dict"},
            "members": {
                "type": "list",
                "elements": "dict",
                "options": {
                    "host": {"type": "str", "required": True},
                    "result": {"type": "dict", "required": True},
                    "preboot_gpus": {"type": "list", "elements": "dict", "required": True},
                    "gpus": {"type": "list", "elements": "int", "required": True},
                },
            },
        },
    },
}
REQUIRED_IF: list[list[Any]] = [
    ["state", "query", ["store", "host_class", "compat"]],
    ["state", "latest", ["store", "host_class"]],
    ["state", "present", ["store", "host_class", "compat"]],
    ["state", "present", ["profile", "canary"], True],
    ["state", "build", ["canary"]],
]


class ActionModule(ActionBase):  # type: ignore[misc]  # ActionBase is Any: ansible-core ships no type information
    """Query or record a reference profile in a profile store."""

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)
    _requires_connection = False

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result: dict[str, Any] = super().run(tmp, task_vars)
        del tmp
        _validation, args = self.validate_argument_spec(
            argument_spec=ARGUMENT_SPEC,
            required_if=REQUIRED_IF,
            mutually_exclusive=[["profile", "canary"]],
        )
        if args["canary"] and args["state"] not in ("present", "build"):
            raise AnsibleActionFail(f"canary: only used with state present or build, not {args['state']}")
        built = None
        if args["canary"]:
            try:
                built = self._reference_from_canary(args["canary"])
            except ReferenceError as exc:
                result.update(failed=True, msg=f"kv_profile ({args['host_class'] or 'canary'}): {exc}")
                return result
        if args["state"] == "build":
            # nothing read or written: the profile a state=present run would record
            result.update(changed=False, reference_profile=built,
                          msg=f"reference profile built from the canary ({len(built['ranks']) if built else 0} rank(s)); not recorded")
            return result
        try:
            store = ProfileStore(args["store"])
            if args["state"] == "latest":
                records, corrupt = store.scan(args["host_class"])
                newest = records[0] if records else None
                result.update(changed=False, status="found" if newest else "missing", profile=newest,
                              key_hash=newest["key_hash"] if newest else None, count=len(records), corrupt=corrupt,
                              msg=(f"newest profile of class {args['host_class']}: {newest['path']}" if newest
                                   else f"class {args['host_class']} has no reference profile yet"))
                return result
            key = compat_key(args["compat"])
            if args["state"] == "query":
                answer = store.query(args["host_class"], key)
                result.update(answer)
                result["changed"] = False
                result["compat"] = key.fields
                if answer["corrupt"]:
                    result["warnings"] = [f"unreadable profile skipped: {c['error']}" for c in answer["corrupt"]]
                if answer["status"] == "found":
                    result["msg"] = f"profile found: {answer['profile']['path']}"
                elif answer["status"] == "mismatch":
                    fields = ", ".join(d["field"] for d in answer["differences"])
                    result["msg"] = (
                        f"class {args['host_class']} has no profile for key {key_hash(key)}; the newest one differs in: {fields}. "
                        "Run a profiled canary for the new key."
                    )
                else:
                    result["msg"] = f"class {args['host_class']} has no reference profile yet"
                return result

            payload = {"host_class": args["host_class"], "compat": key.fields, "profile": built if built is not None else args["profile"]}
            if self._task.check_mode:
                record = store.build_record(payload)
                record["path"] = None
                result["msg"] = "check mode: a new profile would be recorded"
            else:
                record = store.record(payload)
                result["msg"] = f"profile recorded: {record['path']}"
            result["changed"] = True
            result["record"] = record
            result["key_hash"] = record["key_hash"]
            result["profile"] = record
            if built is not None:
                result["reference_profile"] = built
            if self._task.diff:
                result["diff"] = {
                    "before": "",
                    "after": store.dump(record),
                    "before_header": "(no file)",
                    "after_header": record["path"] or f"{store.path}/{args['host_class']}/<new profile>",
                }
        except (ProfileStoreError, CompatError) as exc:
            result.update(failed=True, msg=f"kv_profile ({args['host_class']}): {exc}")
        return result

    def _reference_from_canary(self, canary: Mapping[str, Any]) -> dict[str, Any]:
        """The reference profile of a profiled canary (the builder the kv_reference filter runs too)."""
        try:
            config = model_config_from(canary["model_config"], canary["model_config_file"], self._read_controller_file)
        except ReferenceError as exc:
            raise ReferenceError(f"canary.{exc}") from None
        try:
            return reference_from_canary(canary["result"], canary["preboot_gpus"], canary["gpus"], config=config,
                                         serve_args=canary["serve_args"], canary=canary["facts"], members=canary["members"])
        except (KeyError, TypeError, ValueError) as exc:  # ReferenceError is a ValueError
            raise ReferenceError(f"canary: {exc}") from None

    def _read_controller_file(self, path: str) -> str:
        """A controller file, found as ansible.builtin.file finds it (role and playbook files/ for a relative path)."""
        try:
            found = path if os.path.isabs(path) else self._find_needle("files", path)
            text: str = self._loader.get_text_file_contents(found)
        except (AnsibleError, OSError) as exc:
            raise ReferenceError(f"model_config: cannot read {path}: {exc}") from None
        return text
