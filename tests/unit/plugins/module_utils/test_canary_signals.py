# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The canary's signal handling: one signal stops it, a second one does not cut its cleanup short."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._canary import Terminated, raise_on_termination, termination_deferred


def test_the_first_signal_raises_and_the_next_ones_wait_for_the_restorer():
    before = signal.getsignal(signal.SIGTERM)
    restore = raise_on_termination()
    cleaned = False
    try:
        with pytest.raises(Terminated, match="received signal 1"):
            os.kill(os.getpid(), signal.SIGHUP)
        # systemd's SIGTERM after its SIGHUP: ignored while the cleanup runs
        os.kill(os.getpid(), signal.SIGTERM)
        cleaned = True
    finally:
        restore()
    assert cleaned and signal.getsignal(signal.SIGTERM) is before


def test_a_signal_during_a_deferred_block_is_raised_once_the_block_is_done():
    """Also while another thread runs (the kernel may hand the signal to it; Python still runs the handler here)."""
    other = threading.Thread(target=time.sleep, args=(1.0,), daemon=True)
    other.start()
    restore = raise_on_termination()
    done = []
    try:
        with pytest.raises(Terminated, match="received signal 15"):
            with termination_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("started everything again")
    finally:
        restore()
    assert done == ["started everything again"]
