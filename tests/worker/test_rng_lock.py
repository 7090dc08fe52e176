"""The lock on the global generators: exclusive for what draws, shared for steps that must not."""

from __future__ import annotations

import threading

from worker.rng import RngLock


def test_shared_holders_hold_it_at_once_and_an_exclusive_one_waits_for_them() -> None:
    lock, both, order = RngLock(), threading.Barrier(2, timeout=10), []

    def step() -> None:
        with lock.shared():
            both.wait()  # two shared holders at once: neither waits for the other
            order.append("shared")

    threads = [threading.Thread(target=step) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    with lock:
        order.append("exclusive")
    assert order == ["shared", "shared", "exclusive"]


def test_a_shared_holder_taking_it_exclusively_steps_aside_without_a_deadlock() -> None:
    """A spilled array's step plans its costs under the exclusive lock while its step holds
    it shared: it waited for its own shared hold to end, for ever."""
    lock = RngLock()
    with lock.shared() as held:
        with lock, lock:  # reentrant
            pass
        assert held.undisturbed()  # its own exclusive hold, not another thread's
