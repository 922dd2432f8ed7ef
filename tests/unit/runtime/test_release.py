"""Releasing distributed pipes' process groups at interpreter exit (fxpipe.runtime.transport.release)."""

import gc

from fxpipe.runtime.transport import release


class _Runtime:
    def __init__(self, fails=False):
        self.fails, self.released = fails, 0

    def release(self):
        self.released += 1
        if self.fails:
            raise RuntimeError("already closed")


def test_release_all_releases_every_live_runtime_even_after_one_fails():
    a, b = _Runtime(fails=True), _Runtime()
    release.track(a)
    release.track(b)
    release.release_all()
    assert a.released == 1 and b.released == 1


def test_a_runtime_freed_before_exit_is_not_held():
    gone = _Runtime()
    release.track(gone)
    del gone
    gc.collect()
    assert not any(isinstance(r, _Runtime) and r.released == 0 for r in release._LIVE)
