# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin for gpufleet.vllm.kv_profile: read or record reference profiles on the controller."""

from __future__ import annotations

from typing import Any

from ansible.plugins.action import ActionBase

from ansible_collections.gpufleet.vllm.plugins.module_utils._compat import CompatError, compat_key
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._profile_store import ProfileStore, ProfileStoreError

ARGUMENT_SPEC: dict[str, Any] = {
    "store": {"type": "path", "required": True},
    "state": {"type": "str", "default": "query", "choices": ["query", "present", "latest"]},
    "host_class": {"type": "str", "required": True},
    "compat": {"type": "dict"},
    "profile": {"type": "dict"},
}


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
            required_if=[["state", "present", ["profile", "compat"]], ["state", "query", ["compat"]]],
        )
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
                        f"class {args['host_class']} has no profile for key {key.hash}; the newest one differs in: {fields}. "
                        "Run a profiled canary for the new key."
                    )
                else:
                    result["msg"] = f"class {args['host_class']} has no reference profile yet"
                return result

            payload = {"host_class": args["host_class"], "compat": key.fields, "profile": args["profile"]}
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
