"""Failures on a fabric whose worker processes the test owns (``expertmesh router`` + two
``expertmesh worker``): a killed worker, a stalled one, the GIL released during a blocked call,
Ctrl-C (a signal handler's exception) interrupting a blocked call.

demo-small's placement: cpu0 holds experts 0-19, cpu1 16-31 and replicas of 0-3. A call of 64
random tokens needs experts 20-31 (only on cpu1) with near certainty.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import numpy as np
import pytest

import expertmesh
from expertmesh import aio
from fabric_util import SplitFabric

H = 1024


@pytest.fixture()
def own_fabric(tmp_path):
    # Hedging to a replica only after 5 s: a stalled worker is not worked around within the
    # deadlines below.
    f = SplitFabric(
        tmp_path,
        router_args=("--batch-window-us", "100", "--micro-batch", "16", "--straggler-ms", "5000", "--mode", "exact"),
    )
    yield f
    f.close()


def needs_cpu1(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((64, H), dtype=np.float32)


def test_a_killed_worker_raises_device_down_within_the_deadline(own_fabric):
    f = own_fabric
    with f.client() as c:
        x = needs_cpu1()
        want = c.moe(2, x)
        # requests in flight when the worker dies fail (or complete), each within its deadline
        handles = [c.submit(2, x, deadline_ms=3000) for _ in range(6)]
        f.workers[1].kill()
        f.workers[1].wait()
        t0 = time.monotonic()
        for h in handles:
            try:
                np.testing.assert_array_equal(c.wait(h), want)
            except (expertmesh.DeviceDown, expertmesh.DeadlineExceeded) as e:
                assert e.code in (6, 7)
        # each ends by its 3 s deadline (the bound leaves room for a loaded machine)
        assert time.monotonic() - t0 < 8.0
        # after the death: the documented exception, naming the device, within the deadline
        for i in range(3):
            t = time.monotonic()
            with pytest.raises((expertmesh.DeviceDown, expertmesh.DeadlineExceeded)) as e:
                c.moe(2, needs_cpu1(10 + i), deadline_ms=3000)
            took = time.monotonic() - t
            assert took < 6.0, f"raised after {took:.2f} s, deadline 3 s"
            assert "local/cpu1" in str(e.value), str(e.value)
            assert isinstance(e.value, expertmesh.RouterError)
            assert e.value.request_id and e.value.code_name in ("PeerUnavailable", "DeadlineExceeded")
        # once the router has noticed, it is DeviceDown (PeerUnavailable), without waiting for
        # the deadline (which would raise DeadlineExceeded; the bound is a hang guard well
        # below that 30 s deadline, not a speed test)
        t = time.monotonic()
        with pytest.raises(expertmesh.DeviceDown) as e:
            c.moe(2, needs_cpu1(20), deadline_ms=30_000)
        assert e.value.code == 7 and time.monotonic() - t < 20.0
        # tokens that need only cpu0's experts are still served: a token routed by logits
        # that favour experts 0-3 (cpu0 owns them; cpu1 replicates them)
        logits = np.full((1, 32), -10.0, np.float32)
        logits[0, :4] = 10.0
        y = c.moe(2, needs_cpu1(30)[:1], logits=logits)
        assert np.isfinite(y).all()


def test_the_gil_is_released_while_a_call_is_in_flight(own_fabric):
    f = own_fabric
    # The other thread notes the times it runs at. A call that holds the GIL for the whole
    # second it blocks leaves it no run in the middle of that second, however fast or busy
    # the machine; a call that releases it lets it run there (no count of its steps, which
    # depends on the CPU).
    window = [float("inf"), float("-inf")]
    ran_inside = threading.Event()
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            now = time.monotonic()
            if window[0] < now < window[1]:
                ran_inside.set()

    with f.client() as c:
        x = needs_cpu1(2)
        c.moe(1, x)
        f.workers[1].send_signal(signal.SIGSTOP)  # the call now blocks until its deadline
        try:
            th = threading.Thread(target=spin)
            th.start()
            t = time.monotonic()
            # The middle of the 1 s the call blocks at least (it ends at its deadline).
            window[0], window[1] = t + 0.3, t + 0.7
            with pytest.raises(expertmesh.DeadlineExceeded) as e:
                c.moe(1, x, deadline_ms=1000)
            took = time.monotonic() - t
            stop.set()
            th.join()
        finally:
            f.workers[1].send_signal(signal.SIGCONT)
        assert 0.9 < took < 30.0, took
        assert "local/cpu1" in str(e.value)
        assert ran_inside.is_set(), f"the other thread never ran while the call blocked ({took:.2f} s)"


def test_a_signal_interrupts_a_blocked_call_and_the_connection_stays_usable(own_fabric):
    f = own_fabric

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted()

    with f.client() as c:
        x = needs_cpu1(3)
        want = c.moe(0, x)
        f.workers[1].send_signal(signal.SIGSTOP)
        old = signal.signal(signal.SIGALRM, handler)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            t = time.monotonic()
            with pytest.raises(Interrupted):
                c.moe(0, x, deadline_ms=30_000)
            # Interrupted, not ended by its 30 s deadline (a hang guard, not a speed test).
            assert time.monotonic() - t < 20.0
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            f.workers[1].send_signal(signal.SIGCONT)
        np.testing.assert_array_equal(c.moe(0, x), want)


def test_close_on_another_thread_abandons_a_blocked_call(own_fabric):
    """close() does not wait for a call another thread has blocked on a stalled worker: that
    call raises ValueError (the client was closed) instead of running to its deadline, and the
    fabric serves a new client afterwards."""
    f = own_fabric
    c = f.client()
    x = needs_cpu1(4)
    want = c.moe(1, x)
    outcome = {}

    def call():
        try:
            c.moe(1, x, deadline_ms=120_000)
            outcome["r"] = "returned"
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion below
            outcome["r"] = e

    f.workers[1].send_signal(signal.SIGSTOP)  # the call blocks until its deadline
    try:
        th = threading.Thread(target=call)
        th.start()
        time.sleep(0.3)  # most likely in flight by now; if not, it starts closed: same outcome
        c.close()
        th.join()  # a call close() left blocked would end only at its deadline, in error
    finally:
        f.workers[1].send_signal(signal.SIGCONT)
    assert isinstance(outcome["r"], ValueError), outcome
    assert "closed" in str(outcome["r"])
    assert c.closed
    with f.client() as again:
        np.testing.assert_array_equal(again.moe(1, x), want)


def _alarm(handler, seconds: float):
    """Run ``handler`` on SIGALRM ``seconds`` from now; returns the old handler to restore."""
    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    return old


def _no_alarm(old) -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def cpu0_only() -> tuple[np.ndarray, np.ndarray]:
    """One token whose logits choose experts 0-3 (cpu0 holds them): served with cpu1 stopped."""
    logits = np.full((1, 32), -10.0, np.float32)
    logits[0, :4] = 10.0
    return needs_cpu1(40)[:1], logits


def test_a_signal_handler_may_close_the_client_or_call_another(own_fabric):
    """A handler that interrupts a blocked call may close that client (the call raises
    ValueError at once instead of hanging on the client it interrupted) or call another client
    (served, not a PanicException from starting a runtime inside the blocked one)."""
    f = own_fabric
    x = needs_cpu1(5)
    c, other = f.client(), f.client()
    c.moe(1, x)
    y, logits = cpu0_only()
    want_other = other.moe(2, y, logits=logits)
    got = {}

    def call_other(signum, frame):
        got["other"] = other.moe(2, y, logits=logits)

    def close_it(signum, frame):
        c.close()

    f.workers[1].send_signal(signal.SIGSTOP)
    try:
        old = _alarm(call_other, 0.3)
        try:
            with pytest.raises(expertmesh.DeadlineExceeded):
                c.moe(1, x, deadline_ms=1500)
        finally:
            _no_alarm(old)
        np.testing.assert_array_equal(got["other"], want_other)
        old = _alarm(close_it, 0.3)
        try:
            t = time.monotonic()
            with pytest.raises(ValueError, match="closed"):
                c.moe(1, x, deadline_ms=120_000)
            # Not a speed: a call the close did not reach would end only at its deadline.
            assert time.monotonic() - t < 60.0
        finally:
            _no_alarm(old)
    finally:
        f.workers[1].send_signal(signal.SIGCONT)
    assert c.closed
    other.close()


def test_a_handler_calling_the_client_it_interrupted_is_refused_not_a_deadlock(own_fabric):
    f = own_fabric
    x = needs_cpu1(6)
    with f.client() as c:
        want = c.moe(1, x)

        def same_client(signum, frame):
            c.moe(1, x)

        f.workers[1].send_signal(signal.SIGSTOP)
        try:
            old = _alarm(same_client, 0.3)
            try:
                with pytest.raises(RuntimeError, match="would wait for itself"):
                    c.moe(1, x, deadline_ms=10_000)
            finally:
                _no_alarm(old)
        finally:
            f.workers[1].send_signal(signal.SIGCONT)
        np.testing.assert_array_equal(c.moe(1, x), want)


def test_ctrl_c_reaches_a_thread_waiting_for_a_client_another_thread_uses(own_fabric):
    """A thread waiting for the client while another thread's call has it still answers a
    signal (Ctrl-C), instead of sitting out the other call's deadline."""
    f = own_fabric
    x = needs_cpu1(7)

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted()

    with f.client() as c:
        want = c.moe(1, x)
        f.workers[1].send_signal(signal.SIGSTOP)
        def busy_call():
            try:
                c.moe(1, x, deadline_ms=120_000)
            except expertmesh.Error:
                pass  # its deadline, or answered after the worker resumed: either is fine here

        busy = threading.Thread(target=busy_call)
        try:
            busy.start()
            time.sleep(0.3)  # the other thread's call has the client by now, most likely
            old = _alarm(handler, 0.3)
            try:
                t = time.monotonic()
                with pytest.raises(Interrupted):
                    c.moe(1, x, deadline_ms=120_000)
                # Not a speed: without the signal it would wait out the other call (120 s).
                assert time.monotonic() - t < 60.0, "waited for the other call's deadline"
            finally:
                _no_alarm(old)
        finally:
            f.workers[1].send_signal(signal.SIGCONT)
            busy.join()
        np.testing.assert_array_equal(c.moe(1, x), want)


def test_an_asyncio_client_serves_a_second_event_loop_after_the_first_closed_mid_call(own_fabric):
    """A connection whose call was still running (on a stalled worker) when its event loop
    closed comes back to the pool once the call ends (it was lost, and the next loop's call
    waited for ever), and the client serves a later ``asyncio.run``."""
    f = own_fabric
    x = needs_cpu1(8)
    with f.client() as plain:
        want = plain.moe(1, x)
    c = aio.RouterClient(f.addr, f.cluster, f.secret or "", connections=1)

    async def abandon():
        # The awaiting task gives up; the call runs on, blocked, after this loop has closed.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(c.moe(1, x, deadline_ms=30_000), 0.3)

    async def again():
        return await asyncio.wait_for(c.moe(1, x), 30)

    try:
        f.workers[1].send_signal(signal.SIGSTOP)
        try:
            asyncio.run(abandon())
        finally:
            f.workers[1].send_signal(signal.SIGCONT)
        np.testing.assert_array_equal(asyncio.run(again()), want)
        np.testing.assert_array_equal(asyncio.run(again()), want)
    finally:
        c.close()
