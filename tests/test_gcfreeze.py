"""``rrtod.gcfreeze``: a full garbage collection, then what is left kept out of later ones.

Run in a child process each: freezing is process-wide, and the suite's own objects are not
this module's to freeze."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def child(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=60, env={"PATH": "", **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


SETTLE = """
    import gc, weakref
    from rrtod import gcfreeze

    class Node:
        pass

    def cycle():  # garbage only a collection frees (a reference cycle)
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a

    kept, dropped = cycle(), cycle()
    kept_ref, dropped_ref = weakref.ref(kept), weakref.ref(dropped)
    del dropped
    first = gcfreeze.settle()
    frozen = gc.get_freeze_count()
    soon = gcfreeze.settle(again=True)  # within MIN_INTERVAL_S: not again
    del kept  # a frozen cycle dropped: collections leave it
    gc.collect()
    left = kept_ref() is not None
    gcfreeze._last -= gcfreeze.MIN_INTERVAL_S  # a minute later
    later = gcfreeze.settle(again=True)
    once = gcfreeze.settle(again=True, once="first definition")  # within the interval: once
    twice = gcfreeze.settle(again=True, once="first definition")
    gc.unfreeze()
    print(first, frozen > 1000, dropped_ref() is None, soon, left, later, kept_ref() is None,
          once, twice)
"""


def test_settle_collects_then_freezes_and_a_later_one_frees_frozen_cycles_dropped_since():
    # the dropped cycle was collected before the freeze; the kept one was frozen (no
    # collection frees it once dropped), and freed by the settle a minute later; a reason
    # given ``once`` settles the first time it is given, whatever the interval
    assert child(SETTLE).split() == ["True", "True", "True", "False", "True", "True", "True",
                                     "True", "False"]


def test_the_switch_leaves_the_collector_as_python_sets_it():
    out = child("""
        import gc
        from rrtod import gcfreeze
        print(gcfreeze.settle(), gc.get_freeze_count())
    """, RRTO_GC_FREEZE="0")
    assert out == "False 0"
