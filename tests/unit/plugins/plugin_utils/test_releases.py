# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The engine releases a host keeps after a switch (roles/vllm_runtime, tasks/switch.yml)."""

from __future__ import annotations

import pytest

from ansible_collections.gpufleet.vllm.plugins.plugin_utils._releases import ReleaseError, release_history

R = "/opt/vllm/releases/"


def test_upgrades_keep_the_current_release_and_the_ones_before_it():
    history: list[str] = []
    previous = ""
    removed: list[str] = []
    for version in ["a", "b", "c", "d"]:
        out = release_history(history, previous, R + version, 2)
        history, previous = out["keep"], R + version
        removed += out["remove"]
    assert history == [R + "b", R + "c", R + "d"]
    assert removed == [R + "a"]


def test_a_plain_venv_kept_as_a_release_joins_the_history():
    assert release_history([], R + "unmanaged-1", R + "a", 2) == {"keep": [R + "unmanaged-1", R + "a"], "remove": []}


def test_switching_back_keeps_the_release_it_leaves():
    out = release_history([R + "a", R + "b"], R + "b", R + "a", 1)
    assert out == {"keep": [R + "b", R + "a"], "remove": []}


def test_switching_to_the_current_release_changes_nothing():
    assert release_history([R + "a", R + "b"], R + "b", R + "b", 2) == {"keep": [R + "a", R + "b"], "remove": []}


def test_keep_previous_zero_keeps_only_the_current_release():
    assert release_history([R + "a", R + "b"], R + "b", R + "c", 0) == {"keep": [R + "c"], "remove": [R + "a", R + "b"]}


def test_keep_previous_from_the_command_line_is_a_number():
    assert release_history([R + "a"], R + "a", R + "b", "0") == {"keep": [R + "b"], "remove": [R + "a"]}


@pytest.mark.parametrize("keep", [-1, "two", "-1", True, 1.5, None])
def test_bad_keep_previous_names_the_variable(keep):
    with pytest.raises(ReleaseError, match="vllm_runtime_keep_previous must be a whole number"):
        release_history([], "", R + "a", keep)


@pytest.mark.parametrize("history", ["not-a-list", [R + "a", "relative"], [None]])
def test_bad_history_is_refused(history):
    with pytest.raises(ReleaseError):
        release_history(history, "", R + "b", 2)


def test_relative_current_is_refused():
    with pytest.raises(ReleaseError, match="the current release must be an absolute path"):
        release_history([], "", "vllm-0.1", 2)
