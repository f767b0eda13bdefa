# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The AWX survey of the drift audit asks what playbooks/audit.yml reads, and only that."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_audit_survey_matches_the_playbook():
    survey = json.loads((REPO / "meta" / "survey-audit.json").read_text(encoding="utf-8"))
    asked = {q["variable"] for q in survey["spec"]}
    playbook = (REPO / "playbooks" / "audit.yml").read_text(encoding="utf-8")
    read = set(re.findall(r"\b(gpufleet_(?:report_dir|reprofile_after_days|profile_store))\b", playbook))
    assert asked == read == {"gpufleet_report_dir", "gpufleet_reprofile_after_days", "gpufleet_profile_store"}
    for question in survey["spec"]:
        # an empty answer means "not given": the playbook falls back to the inventory or its default
        assert question["required"] is False and question["default"] == "", question["variable"]
