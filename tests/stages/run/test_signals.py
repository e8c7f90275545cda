import signal

import pytest

from stages.run import signals


def test_a_raising_handler_does_not_swallow_a_sigterm_held_beside_it():
    """SIGTERM arrives first and SIGCHLD's handler raises (as DataLoader's does for a dead
    worker): both are delivered once the block ends, SIGTERM last, and its SystemExit is what
    comes out; the handlers are back as they were."""
    seen = []

    def on_child(signum, frame):
        seen.append("child")
        raise RuntimeError("a worker died")

    def on_term(signum, frame):
        seen.append("term")
        raise SystemExit(143)

    before = {signal.SIGCHLD: signal.signal(signal.SIGCHLD, on_child),
              signal.SIGTERM: signal.signal(signal.SIGTERM, on_term)}
    try:
        with pytest.raises(SystemExit) as stopped:
            with signals.deferred(signal.SIGTERM, signal.SIGCHLD):
                signal.raise_signal(signal.SIGTERM)
                signal.raise_signal(signal.SIGCHLD)
                assert seen == []
        assert stopped.value.code == 143
        assert seen == ["child", "term"]
        assert signal.getsignal(signal.SIGCHLD) is on_child
        assert signal.getsignal(signal.SIGTERM) is on_term
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
