"""The preemption handler on a stub trainer: real signals to this process set the stop request,
a step that carries it ends the run with exit 4, a second signal stops at once, and the handlers
that were there before come back on close. The drill in a real run (checkpoint, exit 4, resume
bit for bit): tests/callbacks/test_rollback.py."""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace

import pytest

from bigtrain.callbacks import preempt
from bigtrain.callbacks.preempt import PreemptionHandler
from bigtrain.errors import Preempted
from tests.stubs import StubTrainer

pytestmark = pytest.mark.unit


@pytest.fixture
def handlers():
    """The SIGTERM/SIGUSR1 handlers of this test process, put back whatever the test did."""
    before = {sig: signal.getsignal(sig) for sig in preempt.SIGNALS}
    yield before
    for sig, handler in before.items():
        signal.signal(sig, handler)


def started(tmp_path) -> tuple[StubTrainer, PreemptionHandler]:
    handler = PreemptionHandler()
    trainer = StubTrainer(tmp_path, [handler])
    trainer.callbacks.on_start(trainer)
    return trainer, handler


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_only_records_the_stop_request(tmp_path, handlers, sig):
    trainer, _ = started(tmp_path)
    assert trainer.stop_signal is None
    signal.raise_signal(sig)
    assert trainer.stop_signal == sig.name
    trainer.step_end()  # the request has not reached a step yet: the run goes on
    assert trainer.step == 1 and not trainer.events()


def test_a_step_with_the_request_raises_preempted_with_exit_4(tmp_path, handlers):
    trainer, _ = started(tmp_path)
    signal.raise_signal(signal.SIGTERM)
    trainer.healthy(7)
    with pytest.raises(Preempted) as raised:
        trainer.step_end(preempt=True)
    assert raised.value.exit_code == 4
    assert str(raised.value) == "preempted: SIGTERM at step 8; checkpointed at step 8, exit 4"
    (event,) = trainer.events()
    assert (event["kind"], event["step"], event["checkpoint_step"]) == ("preempt", 8, 8)
    assert event["reason"] == "SIGTERM at step 8"


def test_a_request_from_another_rank_stops_this_one_too(tmp_path, handlers):
    trainer, _ = started(tmp_path)  # no signal here
    with pytest.raises(Preempted, match="a signal on another rank at step 1"):
        trainer.step_end(preempt=True)


def test_a_second_signal_stops_at_once_the_default_way(tmp_path, handlers, monkeypatch):
    sent = []
    fake_os = SimpleNamespace(getpid=os.getpid, kill=lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(preempt, "os", fake_os)
    trainer, _ = started(tmp_path)
    signal.raise_signal(signal.SIGUSR1)
    assert sent == [] and trainer.stop_signal == "SIGUSR1"
    signal.raise_signal(signal.SIGTERM)
    assert sent == [(os.getpid(), signal.SIGTERM)]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_close_puts_the_previous_handlers_back(tmp_path, handlers):
    previous = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: previous.append(signum))
    before = {sig: signal.getsignal(sig) for sig in preempt.SIGNALS}
    trainer, handler = started(tmp_path)
    assert all(signal.getsignal(sig) != before[sig] for sig in preempt.SIGNALS)
    trainer.callbacks.close()
    assert {sig: signal.getsignal(sig) for sig in preempt.SIGNALS} == before
    assert handler.previous == {}
    signal.raise_signal(signal.SIGUSR1)
    assert previous == [signal.SIGUSR1] and trainer.stop_signal is None
    trainer.callbacks.close()  # a second close (every exit path closes) changes nothing
    assert signal.getsignal(signal.SIGUSR1) == before[signal.SIGUSR1]


def test_outside_the_main_thread_no_handler_is_installed(tmp_path, handlers):
    handler = PreemptionHandler()
    trainer = StubTrainer(tmp_path, [handler])
    thread = threading.Thread(target=trainer.callbacks.on_start, args=(trainer,))
    thread.start()
    thread.join()
    assert handler.previous == {}
    assert {sig: signal.getsignal(sig) for sig in preempt.SIGNALS} == handlers
