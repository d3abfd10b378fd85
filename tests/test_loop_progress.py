"""The loop build's start-up progress (engine/loop/progress.py): stages in the log, and CompileAhead,
which compiles kernels on a thread while the main thread goes on."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from blink_appliance.engine.loop.progress import CompileAhead, stage

CPU = torch.device("cpu")


def test_a_stage_logs_what_runs_and_how_long_it_took(caplog):
    caplog.set_level(logging.INFO, logger="blink_appliance.engine.loop")
    with stage("compiling something"):
        pass
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "compiling something ...",
        "compiling something",
    ]
    assert caplog.records[1].getMessage().startswith("compiling something: done in ")


def test_compile_ahead_runs_beside_the_caller_and_wait_returns_once_it_is_done(caplog):
    """The compile blocks until the caller, after CompileAhead returned, lets it go: so it runs on a
    thread of its own, and wait() returns only after it finished."""
    caplog.set_level(logging.INFO, logger="blink_appliance.engine.loop")
    go, finished = threading.Event(), threading.Event()
    main = threading.get_ident()
    seen: list[int] = []

    def compile_kernels() -> None:
        seen.append(threading.get_ident())
        assert go.wait(timeout=60), "the caller never let the compile go on"
        finished.set()

    ahead = CompileAhead("compiling the kernels", compile_kernels, CPU)
    assert not finished.is_set()
    go.set()
    ahead.wait()
    assert finished.is_set() and seen and seen[0] != main
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "compiling the kernels: started in the background ..."
    assert any(m.startswith("compiling the kernels: compiled in ") for m in messages)
    assert messages[-1].startswith("compiling the kernels: waiting for it: done in ")


def test_a_failed_compile_is_raised_by_wait_naming_what_failed():
    def compile_kernels() -> None:
        raise ValueError("ptxas ran out of registers")

    ahead = CompileAhead("compiling the schedule kernel", compile_kernels, CPU)
    with pytest.raises(RuntimeError, match="compiling the schedule kernel failed: ptxas ran out") as info:
        ahead.wait()
    assert isinstance(info.value.__cause__, ValueError)
