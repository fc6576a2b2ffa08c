"""Shared by the tests of threads and fork: run a check in several threads, or in a forked child."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any, Callable

import pytest


def in_threads(check: Callable[[int], None], count: int) -> None:
    """Run ``check(i)`` for i in 0..count-1 at once, each in its own thread; fail naming every
    thread whose check raised."""
    errors = []

    def run(i: int) -> None:
        try:
            check(i)
        except Exception as e:  # reported below with the thread's index
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def _report(target: Callable[..., Any], args: tuple, queue: multiprocessing.Queue) -> None:
    try:
        queue.put(target(*args))
    except RuntimeError as e:
        queue.put(str(e))


def in_forked_child(target: Callable[..., Any], *args: Any) -> Any:
    """What ``target(*args)`` returns in a child forked from this process (or the message of the
    RuntimeError it raised); fails the test if the child hangs."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_report, args=(target, args, queue))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung")
    return queue.get(timeout=5)
