# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Every play of the collection's playbooks that touches a managed host bounds each remote call
(``timeout: gpufleet_remote_timeout``), so that a lost link or a hung transfer fails that host's
task instead of holding the run; plays on the controller alone need none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOKS = sorted([*(ROOT / "playbooks").glob("*.yml"), *(ROOT / "playbooks" / "plays").glob("*.yml"), *(ROOT / "playbooks" / "tasks").glob("*.yml")])
BOUND = '{{ gpufleet_remote_timeout | default(600) | int }}'


def plays(path: Path) -> list[dict[str, Any]]:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [p for p in doc or [] if isinstance(p, dict) and "hosts" in p]


def test_the_playbooks_are_found():
    assert any(plays(p) for p in PLAYBOOKS), "no play found"


@pytest.mark.parametrize("path", PLAYBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_play_on_managed_hosts_bounds_its_remote_calls(path: Path):
    for play in plays(path):
        if str(play["hosts"]).strip() == "localhost":
            continue
        if play.get("connection") == "local":
            continue
        assert play.get("timeout") == BOUND, f"{path.name}: play {play.get('name')!r} ({play['hosts']}) sets no timeout {BOUND}"
