"""Loops in a sequence definition: recorded once, unrolled for each inference's count.

A detector's post-processing runs a Python loop over its detections (``for i in
range(len(boxes))``): the same calls once per box, as many times as the data decides. A
definition keeps such a loop as one recorded iteration (``SeqLoop``), and both replay ends
unroll it when they reach it, from the count their own tensors give: the shim from the sizes
the host answered, the host from its tensor. Until then each runs the definition's *head*, the
calls before its first loop (``head``); at the loop, each swaps in ``unroll(d, count)``, whose
first calls are exactly the head's, so the values made so far keep their local indices.

Unrolled, iteration ``i`` of the loop is its recorded calls with:

- the local ids its calls make renamed (iteration 0 keeps the recorded ones; ``_renamed``);
- its reads of its own values renamed alike; reads of values made before the loop unchanged;
- integer arguments that are the loop index (``SymbolicInt.index``) set to ``i``;
- its other symbolic integers kept, naming the iteration's own tensors;
- its reads of a scattered call's output (``SeqLoop.scatters``: ``for c in t`` unbinds ``t``
  before the loop) naming that call's output ``i``; the call makes ``count`` outputs.

The calls after the loop move by ``(count - 1) * body``; a list argument that gathers one
tensor per iteration (``SeqLoop.gathers``: ``torch.stack(points)``) gets ``count`` items.

What a loop and the calls after it may read is restricted (``check``) to values of the
inference, weights (``PERSISTENT``), and inputs whose bytes the definition carries
(``SeqSource.fixed``): never fresh inputs or constants, whose per-slot state (the data last
sent, a constant released) the ends keep for the head only, whose slots no unrolling renumbers.
A weight read in a loop is bound per slot of the definition as recorded: ``unroll`` says which
recorded slot each of its slots comes from (``origins``), and both ends keep a weight's binding
under that one, so binding it once serves every iteration and every count.

A loop with variants (``SeqLoop.variants``: torchvision's mask pasting, whose calls after
``max(box[0], 0)`` depend on ``box[0] < 0``) makes its body, then in each iteration the calls of
the variant that the values of its ``guards`` choose (``choose``). Both ends need every
iteration's choice to unroll: the host runs the bodies of all iterations first
(``bodies(d, count)``), reads the guards from its own tensors and goes on with
``unroll(d, count, choices=..., bodies_first=True)``, whose first calls are exactly those; the
shim unrolls in the app's order from the guard values the host pushes. A body writes nothing in
place, and no variant writes what a body reads (``check``), so running the bodies first computes
the same values; the two orders name the same local ids at the same local indices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rrto.v1 import ops_pb2
from rrtod.wire import SPAN, int_arg, iter_tensor_refs

SRC = ops_pb2.SeqSource
# Renamed local ids of iterations 1.. (never a store id a client assigns: those stay below
# 1 << 62, ``rrtod.wire``): the top bit, the loop's first call, the iteration, the id's rank.
_RENAMED = 1 << 63
MAX_COUNT = (1 << 20) - 1
# Calls an unrolled definition may have: a count comes from the data, and each replay end
# builds the unrolled calls (a few hundred bytes each) before it runs them.
MAX_CALLS = 1 << 16
MAX_VARIANTS = 16  # variants of one loop (four values read as bools: at most 16)
# A variant's slots in ``unroll``'s ``origins``: past any definition's, numbered per loop (by
# how many loops are left, the same at every stage of unrolling) and variant after variant.
VARIANT_SLOTS = 1 << 40
MAX_GUARDS = 8
# A choice for an iteration whose branch no variant has and that the app ran by forwarding
# (a replay cut there, then resumed: ``unroll``'s ``ordered``): its body, no variant calls.
SKIP = -1


def _renamed(start: int, i: int, j: int) -> int:
    return _RENAMED | (start << 40) | (i << 20) | j


def _made(calls: list[ops_pb2.OpCall]) -> list[int]:
    """Ids the calls make, in order of first appearance: outputs and bound uploads."""
    out: dict[int, None] = {}
    for call in calls:
        for ref in iter_tensor_refs(call):
            if ref.WhichOneof("ref") == "upload" and ref.bind_id:
                out.setdefault(ref.bind_id, None)
        for rid in call.out_ids:
            out.setdefault(rid, None)
    return list(out)


def _slots(calls: list[ops_pb2.OpCall]) -> int:
    return sum(1 for call in calls for _ in iter_tensor_refs(call))


def _first(loop: ops_pb2.SeqLoop) -> int:
    """Where a loop's unrolled calls begin: its first scattered call, else its body."""
    return min([loop.start, *loop.scatters])


def head_end(d: ops_pb2.SequenceDef) -> int:
    """The number of calls of ``d``'s head: those before its first loop (and that loop's
    scattered calls, whose outputs are as many as the count)."""
    return _first(d.loops[0]) if d.loops else len(d.calls)


def check(d: ops_pb2.SequenceDef) -> None:
    """ValueError unless ``d``'s loops can be unrolled: in order, inside the definition, each
    counted by a tensor made before it (and its scattered calls), reading (with everything
    after them) only values of the inference and fixed inputs, symbols of a loop naming
    tensors of the head or of its own iteration, gathers after their loop, scattered calls
    of one output between the previous loop and this one."""
    local = set(d.local_ids)
    end = 0
    for n, loop in enumerate(d.loops):
        if loop.body == 0 or _first(loop) < end or loop.start + loop.body > len(d.calls):
            raise ValueError(f"sequence {d.id}: loop {n} is not within the calls after the "
                             "previous one")
        end = loop.start + loop.body
        if len(set(loop.scatters)) != len(loop.scatters) or any(
                c >= loop.start or len(d.calls[c].out_ids) != 1 for c in loop.scatters):
            raise ValueError(f"sequence {d.id}: loop {n} scatters a call that is not one "
                             "of one output before it")
        scattered = {d.calls[c].out_ids[0] for c in loop.scatters}
        if scattered and any(ref.WhichOneof("ref") == "id" and ref.id in scattered
                             for k, call in enumerate(d.calls)
                             if not loop.start <= k < loop.start + loop.body
                             for ref in iter_tensor_refs(call)):
            raise ValueError(f"sequence {d.id}: loop {n} scatters a call whose outputs are read "
                             "outside its body")
        if loop.tensor not in local or loop.tensor not in _made(list(d.calls[: _first(loop)])):
            raise ValueError(f"sequence {d.id}: loop {n} is counted by a tensor not made "
                             "before it")
        for g in loop.gathers:
            if g.call < end or g.call >= len(d.calls):
                raise ValueError(f"sequence {d.id}: loop {n} gathers into no call after it")
        if loop.guards or loop.variants:
            if n != len(d.loops) - 1:  # the host's order would reach past it (``app_pos``)
                raise ValueError(f"sequence {d.id}: loop {n} has variants and is not the last")
            _check_variants(d, n, loop)
    if not d.loops:
        return
    first = _slots(list(d.calls[: head_end(d)]))
    for slot in range(first, len(d.sources)):
        src = d.sources[slot]
        if not (src.kind in (SRC.PRODUCED, SRC.PERSISTENT) or (src.kind == SRC.INPUT
                                                               and src.fixed)):
            raise ValueError(f"sequence {d.id}: slot {slot}, in or after a loop, is not a "
                             "value of the inference, a weight nor a fixed input")
    for sym in d.symbols:
        if sym.index and not any(lp.start <= sym.call < lp.start + lp.body for lp in d.loops):
            raise ValueError(f"sequence {d.id}: call {sym.call} uses a loop index outside "
                             "any loop")


def _check_variants(d: ops_pb2.SequenceDef, n: int, loop: ops_pb2.SeqLoop) -> None:
    """ValueError unless loop ``n``'s variants can be chosen and run after its body: guards the
    body makes, one value each per variant, distinct; each variant's sources, symbols and ids
    its own; the body writing nothing in place and no variant writing what a body reads (the
    host runs the bodies of all iterations first)."""
    where = f"sequence {d.id}: loop {n}"
    body = list(d.calls[loop.start: loop.start + loop.body])
    made = _made(body)
    if not loop.guards or not loop.variants or len(loop.guards) > MAX_GUARDS \
            or len(loop.variants) > MAX_VARIANTS:
        raise ValueError(f"{where} has {len(loop.guards)} guards and {len(loop.variants)} "
                         f"variants (1 to {MAX_GUARDS} and 1 to {MAX_VARIANTS})")
    if any(g not in made or g not in d.outputs or g not in d.local_ids for g in loop.guards) \
            or len(set(loop.guards)) != len(loop.guards):
        raise ValueError(f"{where} has a guard its body does not make or the app does not read")
    if {r for call in body for r in call.out_ids} - set(made) or any(
            ref.WhichOneof("ref") == "upload" and ref.bind_id
            for call in body for ref in iter_tensor_refs(call)):
        raise ValueError(f"{where} has a body that writes a value in place")
    read = {ref.id for call in body for ref in iter_tensor_refs(call)
            if ref.WhichOneof("ref") == "id"} | set(loop.guards)
    whens = set()
    for v in loop.variants:
        if len(v.when) != len(loop.guards):
            raise ValueError(f"{where} has a variant with {len(v.when)} values for "
                             f"{len(loop.guards)} guards")
        whens.add(tuple(v.when))
        own = set(_made(list(v.calls)))
        if len(v.sources) != _slots(list(v.calls)) \
                or not set(v.local_ids) <= own or len(set(v.local_ids)) != len(v.local_ids) \
                or not set(v.outputs) <= set(v.local_ids) \
                or set(v.local_ids) & (set(made) | set(d.local_ids)):
            raise ValueError(f"{where} has a variant whose calls, sources or ids disagree")
        if any(r in read and r not in v.local_ids for call in v.calls for r in call.out_ids):
            raise ValueError(f"{where} has a variant that writes what the body reads")
        if any(sym.call >= len(v.calls) for sym in v.symbols):
            raise ValueError(f"{where} has a variant symbol past its calls")
        for src in v.sources:
            if not (src.kind in (SRC.PRODUCED, SRC.PERSISTENT) or (src.kind == SRC.INPUT
                                                                   and src.fixed)):
                raise ValueError(f"{where} has a variant reading what is not a value of the "
                                 "inference, a weight nor a fixed input")
    if len(whens) != len(loop.variants):
        raise ValueError(f"{where} has two variants for the same values")


def choose(loop: ops_pb2.SeqLoop, values: list[tuple[float, ...]]) -> list[int]:
    """Per iteration, the index of the variant whose ``when`` are that iteration's guard
    values. ValueError for values no variant has (the app took a branch not recorded)."""
    out = choose_known(loop, values)
    if len(out) < len(values):
        raise ValueError(f"iteration {len(out)}: no variant for the values "
                         f"{values[len(out)]} read")
    return out


def choose_known(loop: ops_pb2.SeqLoop, values: Iterable[tuple[float, ...]]) -> list[int]:
    """``choose`` up to the first iteration whose values no variant has: the choices of the
    iterations before it, which a *cut* unrolling replays (``unroll``). ``values`` is read
    no further than that iteration (the shim waits for each iteration's as it goes)."""
    index = {tuple(v.when): k for k, v in enumerate(loop.variants)}
    out = []
    for vals in values:
        k = index.get(tuple(float(x) for x in vals))
        if k is None:
            break
        out.append(k)
    return out


def guards(d: ops_pb2.SequenceDef, count: int) -> list[list[int]]:
    """Per iteration of ``d``'s first loop unrolled ``count`` times, the ids of its guards."""
    loop = d.loops[0]
    name = _namer(d)
    return [[name(g, i) for g in loop.guards] for i in range(count)]


def guard_locals(d: ops_pb2.SequenceDef, count: int,
                 layout: Layout | None = None) -> list[list[int]]:
    """Per iteration of ``d``'s first loop unrolled ``count`` times, the local indices of its
    guards in ``bodies(d, count)`` (and so in every unrolling with the bodies first), worked
    out as ``unroll`` lays its local ids out (the head's, then each iteration's own), without
    unrolling: each end asks for them every frame whose count is new to its sequence. -1: a
    guard that is no local value of an iteration. ``layout``: ``d``'s ``layout_of``, if the
    caller keeps it (walking the calls before Mask R-CNN's loop for the ids was 7 ms of each
    of its frames on the host)."""
    before, every = (layout.before, layout.own) if layout is not None else _iteration_ids(d)
    local = set(d.local_ids)
    own = [r for r in every if r in local]
    head = sum(1 for r in d.local_ids if r in before)
    where = {r: j for j, r in enumerate(own)}
    return [[head + i * len(own) + where[g] if g in where else -1 for g in d.loops[0].guards]
            for i in range(count)]


def _iteration_ids(d: ops_pb2.SequenceDef) -> tuple[set[int], list[int]]:
    """What the calls before ``d``'s first loop make (but its scattered calls' outputs), and
    what an iteration makes as its own, in ``unroll``'s order: the output of each scattered
    call it reads, then what its body makes."""
    loop = d.loops[0]
    prefix = list(d.calls[: loop.start])
    body = list(d.calls[loop.start: loop.start + loop.body])
    scattered = [d.calls[c].out_ids[0] for c in loop.scatters]
    before = set(_made(prefix)) - set(scattered)
    return before, [*scattered, *(r for r in _made(body)
                                  if r not in before and r not in scattered)]


@dataclass(frozen=True)
class Layout:
    """What ``unroll`` needs of a definition that no count or choice changes: the ids made
    before its first loop, an iteration's own ids, and the argument slots of the calls before
    the loop and of its body. Worked out once per definition (``layout_of``) and passed to each
    unrolling: walking the calls before Mask R-CNN's paste loop (714) for them was two
    thirds of every frame's unrolling, on both ends."""

    before: frozenset[int]
    own: tuple[int, ...]
    prefix_slots: int
    body_slots: int


def layout_of(d: ops_pb2.SequenceDef) -> Layout:
    """``d``'s ``Layout`` (of its first loop)."""
    loop = d.loops[0]
    before, own = _iteration_ids(d)
    return Layout(frozenset(before), tuple(own), _slots(list(d.calls[: loop.start])),
                  _slots(list(d.calls[loop.start: loop.start + loop.body])))


def shared_calls(d: ops_pb2.SequenceDef, prefix: ops_pb2.SequenceDef, slots: list[int],
                 out_local: list[list[int | None]], copied: int = 0) -> int:
    """How many first calls of ``d`` are ``prefix``'s own: the same call, reading the same
    sources, among the same first local ids, making no id ``d`` makes beyond them. Each
    replay end compiles an unrolling on its compiled head this far (an unrolled loop begins
    with the calls its head, and bodies, ran). ``slots`` and ``out_local``: per call of
    ``prefix``, its number of tensor arguments and its outputs' local indices (None: not one
    of its ids), as its compile has them. ``copied``: ``d``'s first calls and their sources
    are a copy of ``prefix``'s this far (``unroll``'s ``bodies``): not compared again."""
    ids = len(prefix.local_ids)
    if list(d.local_ids[:ids]) != list(prefix.local_ids):
        return 0
    shared, slot, limit = 0, 0, min(len(d.calls), len(prefix.calls))
    if copied == len(prefix.calls) <= len(d.calls):
        # all of them, by ``unroll`` (``bodies``): the ids it adds past the prefix's are a
        # variant's, renamed per iteration, and those the calls after the loop make first
        return copied
    new_ids = set(d.local_ids[ids:])
    while shared < limit:
        call, n = d.calls[shared], slots[shared]
        if shared >= copied and (call != prefix.calls[shared]
                                 or d.sources[slot:slot + n] != prefix.sources[slot:slot + n]):
            break
        if new_ids and any(i is None and r in new_ids for r, i in zip(
                call.out_ids, out_local[shared], strict=True)):
            break  # an id the prefix did not make is one ``d`` makes: not the same call
        slot += n
        shared += 1
    return shared


def _namer(d: ops_pb2.SequenceDef) -> Callable[[int, int], int]:
    """Iteration ``i``'s id of a value the first loop's body makes (``unroll``'s naming)."""
    s = d.loops[0].start
    rank = {r: j for j, r in enumerate(_iteration_ids(d)[1])}

    def name(rid: int, i: int) -> int:
        j = rank.get(rid)
        return rid if j is None or i == 0 else _renamed(s, i, j)
    return name


def bodies(d: ops_pb2.SequenceDef, count: int) -> ops_pb2.SequenceDef:
    """``d``'s head and the bodies of its first loop's ``count`` iterations (a loop with
    variants): what the host runs before it reads the guards. The first calls of
    ``unroll(d, count, choices=..., bodies_first=True)`` for any choices; no outputs, as a
    head (``head``)."""
    return unroll(d, count, bodies_first=True)


def samples(d: ops_pb2.SequenceDef, layout: Layout | None = None) -> list[ops_pb2.SequenceDef]:
    """``d``'s first loop unrolled with no iteration, one and two, each variant at least once
    in each place: what a replay end compiles when it is defined, so that a definition that
    cannot run fails then and not when an inference reaches its loop. ``d`` is checked and
    laid out once for all of them (``layout``: its ``layout_of``, from a caller that has
    checked it first: a definition that fails ``check`` may not even be laid out).

    With ``k`` variants: each alone (the first iteration and the last), then one chain of
    ``k + 1`` iterations, 0, 1, ..., k-1, 0, in the app's order and with the bodies first:
    each variant follows the one before it, as a pair of iterations per variant did, in two
    unrollings where the pairs took ``2k`` (Mask R-CNN's paste loop of 11 variants: 14
    samples, was 34, most of a new definition's time on the host)."""
    if not d.loops:
        return [d]
    if layout is None:
        check(d)
        layout = layout_of(d)

    def sample(count: int, choices: list[int] | None = None,
               bodies_first: bool = False) -> ops_pb2.SequenceDef:
        return unroll(d, count, choices=choices, bodies_first=bodies_first, checked=True,
                      layout=layout)

    k = len(d.loops[0].variants)
    if not k:
        return [sample(n) for n in (0, 1, 2)]
    chain = [*range(k), 0]
    return [sample(0, []), *(sample(1, [v]) for v in range(k)),
            sample(len(chain), chain), sample(len(chain), chain, bodies_first=True)]


def _sizes(loop: ops_pb2.SeqLoop, choices: Iterable[int]) -> list[int]:
    """Per choice, how many calls its variant has (none for ``SKIP``)."""
    return [len(loop.variants[c].calls) if c != SKIP else 0 for c in choices]


def iteration_start(d: ops_pb2.SequenceDef, choices: list[int]) -> int:
    """The app's position of the first call of iteration ``len(choices)`` of ``d``'s first
    loop (of the calls after it, if that is every iteration), the iterations before it having
    taken ``choices``: where a replay cut before it resumes (``ReplayStart.loop_choices``)."""
    loop = d.loops[0]
    return loop.start + loop.body * len(choices) + sum(_sizes(loop, choices))


def app_positions(d: ops_pb2.SequenceDef, count: int, choices: list[int],
                  ordered: int = 0) -> list[int]:
    """Per call of ``unroll(d, count, choices=choices, bodies_first=True, ordered=ordered)``,
    its position in the app's order (``unroll(d, count, choices=choices)``): where the host,
    which runs the bodies first, is when the app is at a given call (an abort's position is
    the app's). With fewer choices than iterations (a cut unrolling), the bodies past the cut
    iteration's are past the app's last call: the app never reaches them replayed."""
    loop = d.loops[0]
    s, b = loop.start, loop.body
    sizes = _sizes(loop, choices)
    starts, at = [], s
    for n in sizes:
        starts.append(at)
        at += b + n
    cut = len(choices) < count
    if cut:
        starts.append(at)  # the cut iteration's body, the app's last replayed calls
        starts += range(at + b, at + b + (count - len(starts)) * b, b)
    out = list(range(s))
    for i in range(ordered):  # (in the app's order: ``unroll``'s ``ordered``)
        out += range(starts[i], starts[i] + b + sizes[i])
    for i in range(ordered, count):
        out += range(starts[i], starts[i] + b)
    for i in range(ordered, len(choices)):
        out += range(starts[i] + b, starts[i] + b + sizes[i])
    if not cut:
        out += range(at, at + len(d.calls) - s - b)
    return out


def head(d: ops_pb2.SequenceDef) -> ops_pb2.SequenceDef:
    """The calls before ``d``'s first loop, as a definition of their own: what each end runs
    until it reaches the loop. No outputs: a value made there may still be written by the loop
    (a buffer filled row by row), so nothing is pushed before the whole is unrolled."""
    if not d.loops:
        return d
    s = head_end(d)
    calls = list(d.calls[:s])
    made = set(_made(calls))
    out = ops_pb2.SequenceDef(id=d.id, thread=d.thread, calls=calls,
                              local_ids=[r for r in d.local_ids if r in made],
                              sources=list(d.sources[: _slots(calls)]),
                              symbols=[sym for sym in d.symbols if sym.call < s])
    if d.HasField("varies_from"):
        out.varies_from = min(d.varies_from, s)
    return out


def counted_by(d: ops_pb2.SequenceDef) -> tuple[int, int] | None:
    """(local index in ``head(d)``, dimension) of the size that counts ``d``'s first loop."""
    if not d.loops:
        return None
    loop = d.loops[0]
    return list(head(d).local_ids).index(loop.tensor), loop.dim


def unroll(d: ops_pb2.SequenceDef, count: int, origins: list[int] | None = None,
           choices: list[int] | None = None, bodies_first: bool = False,
           checked: bool = False, layout: Layout | None = None,
           bodies: ops_pb2.SequenceDef | None = None,
           made_from: list[Any] | None = None, cut: bool = False,
           ordered: int = 0) -> ops_pb2.SequenceDef:
    """``d`` with its first loop run ``count`` times (its other loops moved along, still to be
    unrolled). A loop with variants needs ``choices``, the variant of each iteration
    (``choose``); with ``bodies_first`` the bodies of all iterations come before all their
    variants (the host's order), and without ``choices`` the result ends there (``bodies``).
    ``origins``, if given, receives per slot of the result the slot of ``d`` it comes from
    (a variant's: ``VARIANT_SLOTS`` on, the same at every stage). ValueError if ``d``
    fails ``check`` (not done again when ``checked``: an unrolling for an inference, of a
    definition checked when it was defined; it was a quarter of Mask R-CNN's unrolling) or
    the result would name more local ids than an inference's range holds. ``layout``: ``d``'s
    ``layout_of``, if the caller keeps it. ``bodies``: ``bodies(d, count)``, if the caller
    has it (the host, which ran it): with the bodies first and ``choices``, the result is a
    copy of it and the variants and the calls after the loop (building its calls again was
    most of each Mask R-CNN frame's unrolling on the host). ``made_from``, if given, receives
    per call of the result the recorded call it is made from, the same key for the same
    call whatever its ids: ``("body", q)``, ``("variant", k, q)`` (with the iteration where
    the loop's index is one of its arguments), ``("after", j, count)``; None for a call of the
    head or of the copied bodies (a scattered call's outputs follow the count). The host
    keeps one decoded form of each (``HostReplayer._unroll``).

    ``cut``: ``choices`` may be fewer than ``count`` (``choose_known``): iteration
    ``len(choices)`` took a branch no variant has. The result is what both ends can replay of
    such an inference: the head, the iterations before that one, and its body (with the bodies
    first: every body, then the variants chosen); no calls after, no later loop. Its outputs
    are those its calls make (not the later bodies'), pushed once its calls no longer write
    them: what the app reads up to the cut is answered. The calls after it are the app's,
    forwarded, and one may write such an output in place: a read after that fetches it
    (``ReplayClient.rewritten``).

    ``ordered`` (with the bodies first): the first ``ordered`` iterations come in the app's
    order, each body then its variant, before the bodies of the others: a replay resumed at
    iteration ``ordered`` after a cut (``ReplayStart.loop_choices``), whose calls before it
    ran in an earlier replay or by forwarding; ``choices`` has theirs first, ``SKIP`` for an
    iteration whose branch the app forwarded (its body, no variant). With exactly those
    choices and no ``cut``, the result ends after the bodies (the host reads the guards of
    the iterations resumed next). The local ids are laid out as in every other unrolling."""
    if not checked:
        check(d)
    if not d.loops:
        if origins is not None:
            origins[:] = range(len(d.sources))
        if made_from is not None:
            made_from[:] = [None] * len(d.calls)
        return d
    if not 0 <= count <= MAX_COUNT:
        raise ValueError(f"sequence {d.id}: a loop count of {count}")
    loop, later = d.loops[0], list(d.loops[1:])
    variants = list(loop.variants)
    if variants and choices is None and not bodies_first:
        raise ValueError(f"sequence {d.id}: its loop's variants need a choice per iteration")
    if cut and (choices is None or later):
        raise ValueError(f"sequence {d.id}: only a last loop with variants is cut")
    resumed = bodies_first and choices is not None and not cut and len(choices) == ordered
    cut_at = len(choices) if cut and choices is not None and len(choices) < count else None
    if choices is not None and (len(choices) != count and cut_at is None and not resumed
                                or any(not 0 <= c < len(variants) and c != SKIP
                                       for c in choices)):
        raise ValueError(f"sequence {d.id}: {len(choices)} choices for {count} iterations "
                         f"of {len(variants)} variants")
    if ordered and (not bodies_first or choices is None or not ordered <= len(choices)):
        raise ValueError(f"sequence {d.id}: {ordered} iterations in order need their choices")
    only_bodies = bodies_first and (choices is None or resumed and ordered < count)
    s, b = loop.start, loop.body
    prefix, body, suffix = list(d.calls[:s]), list(d.calls[s: s + b]), list(d.calls[s + b:])
    layout = layout or layout_of(d)
    before, own = layout.before, layout.own
    rank = {r: j for j, r in enumerate(own)}
    # a variant's ids, always renamed (ranks after the body's): no two iterations share one
    vrank = [{r: len(own) + j for j, r in enumerate(v.local_ids)} for v in variants]
    chosen = [variants[c] for c in choices if c != SKIP] if choices is not None else []
    if cut_at is not None:
        suffix = []  # nothing after the cut iteration's body is known
    total = len(prefix) + count * b + sum(len(v.calls) for v in chosen) + len(suffix)
    if total > MAX_CALLS:
        raise ValueError(f"sequence {d.id}: {count} iterations of {b} calls are more than "
                         f"{MAX_CALLS} calls")
    if len(d.local_ids) + count * len(own) + sum(len(v.local_ids) for v in chosen) > SPAN:
        raise ValueError(f"sequence {d.id}: {count} iterations name more local ids than an "
                         f"inference holds ({SPAN})")

    def name(rid: int, i: int) -> int:
        j = rank.get(rid)
        return rid if j is None or i == 0 else _renamed(s, i, j)

    def vname(k: int, rid: int, i: int) -> int:
        j = vrank[k].get(rid)
        return name(rid, i) if j is None else _renamed(s, i, j)

    symbols: dict[int, list[ops_pb2.SymbolicInt]] = {}
    for sym in d.symbols:
        symbols.setdefault(sym.call, []).append(sym)
    n_pre, n_body = layout.prefix_slots, layout.body_slots
    local = set(d.local_ids)
    own_local = [r for r in own if r in local]
    first_slot = [VARIANT_SLOTS + (len(d.loops) << 24)]  # of each variant, in ``origins``
    for v in variants[:-1]:
        first_slot.append(first_slot[-1] + len(v.sources))
    in_order = [c for c in (choices or ())[:ordered] if c != SKIP]
    from_bodies = bodies is not None and bodies_first and choices is not None and not only_bodies
    if from_bodies:  # the head, the bodies, their sources, symbols and ids: as ``bodies``
        assert bodies is not None
        if (len(bodies.calls) != s + count * b + sum(len(variants[c].calls) for c in in_order)
                or len(bodies.sources) != n_pre + count * n_body
                + sum(len(variants[c].sources) for c in in_order)
                or len(bodies.local_ids) != len(before & local) + count * len(own_local)
                + sum(len(variants[c].local_ids) for c in in_order)
                or bodies.outputs or bodies.loops):
            raise ValueError(f"sequence {d.id}: not its bodies of {count} iterations")
        out = ops_pb2.SequenceDef()
        out.CopyFrom(bodies)
        # per slot of the result: the slot of ``d`` it comes from
        body_slots = list(range(n_pre, n_pre + n_body))
        came = list(range(n_pre))
        for c in (choices or ())[:ordered]:
            came += body_slots
            if c != SKIP:
                came += range(first_slot[c], first_slot[c] + len(variants[c].sources))
        came += body_slots * (count - ordered)
        made_of: list[Any] = [None] * len(bodies.calls)
    else:
        out = ops_pb2.SequenceDef(id=d.id, thread=d.thread, calls=prefix,
                                  sources=list(d.sources[:n_pre]),
                                  symbols=[sym for sym in d.symbols if sym.call < s])
        for c in loop.scatters:  # one output per iteration
            call = out.calls[c]
            meta = list(call.out_meta[:1]) * count
            call.out_ids[:] = [name(call.out_ids[0], i) for i in range(count)]
            del call.out_meta[:]
            call.out_meta.extend(meta)
        came = list(range(n_pre))
        made_of = [None] * len(prefix)

    def add(templates: list[ops_pb2.OpCall], sources: Any, slot0: int, syms: Any,
            rename: Callable[[int], int], i: int, tag: tuple[Any, ...]) -> None:
        slot = 0
        for q, template in enumerate(templates):
            at = syms.get(q, ())
            made_of.append((*tag, q, i) if any(sym.index for sym in at) else (*tag, q))
            call = out.calls.add()
            call.CopyFrom(template)
            call.out_ids[:] = [rename(r) for r in template.out_ids]
            for ref in iter_tensor_refs(call):
                src = out.sources.add()
                src.CopyFrom(sources[slot])
                came.append(slot0 + slot)
                slot += 1
                if src.kind == SRC.PRODUCED:
                    src.id = rename(src.id)
                if ref.WhichOneof("ref") == "id":
                    ref.id = rename(ref.id)
                elif ref.WhichOneof("ref") == "upload" and ref.bind_id:
                    ref.bind_id = rename(ref.bind_id)
            for sym in at:
                if sym.index:
                    int_arg(call, sym).i = i
                else:
                    new = out.symbols.add()
                    new.CopyFrom(sym)
                    new.call, new.tensor = len(out.calls) - 1, rename(sym.tensor)

    body_syms = {q - s: syms for q, syms in symbols.items() if s <= q < s + b}
    var_syms = [{} for _ in variants]  # type: list[dict[int, list[ops_pb2.SymbolicInt]]]
    for k, v in enumerate(variants):
        for sym in v.symbols:
            var_syms[k].setdefault(sym.call, []).append(sym)

    def add_body(i: int) -> None:
        add(body, d.sources[n_pre: n_pre + n_body], n_pre, body_syms,
            lambda r: name(r, i), i, ("body",))

    def add_variant(i: int) -> None:
        k = choices[i]  # type: ignore[index]
        if k == SKIP:
            return
        add(list(variants[k].calls), variants[k].sources, first_slot[k], var_syms[k],
            lambda r: vname(k, r, i), i, ("variant", k))

    chosen_of = len(choices) if choices is not None else count
    if bodies_first:
        if not from_bodies:
            for i in range(ordered):
                add_body(i)
                add_variant(i)
            for i in range(ordered, count):
                add_body(i)
        if not only_bodies:
            for i in range(ordered, chosen_of):
                add_variant(i)
    else:
        for i in range(chosen_of):
            add_body(i)
            if variants:
                add_variant(i)
        if cut_at is not None:
            add_body(cut_at)
    shift = len(out.calls) - len(prefix) - b  # where the calls after the loop move
    if not from_bodies:
        out.local_ids.extend(r for r in d.local_ids if r in before)
        out.local_ids.extend(name(r, i) for i in range(count) for r in own_local)
    out.local_ids.extend(vname(c, r, i) for i, c in enumerate(choices or ())
                         if c != SKIP and (i >= ordered or not from_bodies)
                         for r in variants[c].local_ids)
    if cut_at is not None:  # the outputs of the calls it has (the docstring says why)
        out.outputs.extend(r for r in d.outputs if r in before)
        out.outputs.extend(name(r, i) for i in range(cut_at + 1) for r in d.outputs if r in rank)
        out.outputs.extend(vname(c, r, i) for i, c in enumerate(choices or ()) if c != SKIP
                           for r in variants[c].outputs)
    if only_bodies or cut_at is not None:
        out.varies_from = min(d.varies_from, s) if d.HasField("varies_from") else s
        if origins is not None:
            origins[:] = came
        if made_from is not None:
            made_from[:] = made_of
        return out
    gathers: dict[int, set[tuple[object, ...]]] = {}
    for g in loop.gathers:
        gathers.setdefault(g.call, set()).add((g.kwarg or g.arg, *g.items, 0))
    of_one = set(rank) | {r for v in variants for r in v.local_ids}
    slot = n_pre + n_body
    for k, template in enumerate(suffix, start=s + b):
        made_of.append(("after", k, count))
        call = out.calls.add()
        call.CopyFrom(template)
        wanted = gathers.get(k, set())
        for path, _ref in _refs_by_path(template):
            src = d.sources[slot]
            if path in wanted:
                if src.kind != SRC.PRODUCED or src.id not in rank:
                    raise ValueError(f"sequence {d.id}: call {k} gathers no value of the loop")
                for i in range(count):
                    out.sources.add(kind=SRC.PRODUCED, id=name(src.id, i))
                came += [slot] * count
                _expand(_value_at(call, path[:-1]), count, name)
            elif src.kind == SRC.PRODUCED and src.id in of_one:
                raise ValueError(f"sequence {d.id}: call {k} after the loop reads a value of "
                                 "one iteration")
            else:
                out.sources.add().CopyFrom(src)
                came.append(slot)
            slot += 1
        for sym in symbols.get(k, ()):
            if sym.tensor in of_one:
                raise ValueError(f"sequence {d.id}: call {k} after the loop uses a size of a "
                                 "value of one iteration")
            new = out.symbols.add()
            new.CopyFrom(sym)
            new.call = k + shift
    # ids of ``d`` that neither the calls before the loop nor an iteration make: the calls
    # after it make them (a variant's are always renamed)
    made = set(_made(list(out.calls[len(out.calls) - len(suffix):]))) if suffix else set()
    out.local_ids.extend(r for r in d.local_ids if r not in before and r not in rank and r in made)
    out.outputs.extend(r for r in d.outputs if r in before or (r not in rank and r in made))
    out.outputs.extend(name(r, i) for i in range(count) for r in d.outputs if r in rank)
    out.outputs.extend(vname(c, r, i) for i, c in enumerate(choices or ()) if c != SKIP
                       for r in variants[c].outputs)
    if variants:  # a variant's calls follow the data: worked out every time from the loop on
        out.varies_from = min(d.varies_from, s) if d.HasField("varies_from") else s
    elif d.HasField("varies_from"):
        v = d.varies_from
        out.varies_from = v if v < s else s + (v - s if count else 0) if v < s + b else v + shift
    if origins is not None:
        origins[:] = came
    if made_from is not None:
        made_from[:] = made_of
    for lp in later:
        moved = out.loops.add()
        moved.CopyFrom(lp)
        moved.start = lp.start + shift
        moved.scatters[:] = [c + shift for c in lp.scatters]
        for g in moved.gathers:
            g.call += shift
        if lp.tensor in of_one:
            raise ValueError(f"sequence {d.id}: a later loop is counted by a value of one "
                             "iteration")
    return out


def _refs_by_path(call: ops_pb2.OpCall) -> list[tuple[tuple[object, ...], ops_pb2.TensorRef]]:
    """``iter_tensor_refs(call)`` with each ref's path: (argument position or keyword name,
    list indices...)."""
    out: list[tuple[tuple[object, ...], ops_pb2.TensorRef]] = []

    def walk(v: ops_pb2.Value, path: tuple[object, ...]) -> None:
        kind = v.WhichOneof("kind")
        if kind == "tensor":
            out.append((path, v.tensor))
        elif kind in ("list", "tuple"):
            for j, item in enumerate(getattr(v, kind).items):
                walk(item, (*path, j))

    for a, v in enumerate(call.args):
        walk(v, (a,))
    for key in sorted(call.kwargs):
        walk(call.kwargs[key], (key,))
    return out


def _value_at(call: ops_pb2.OpCall, path: tuple[object, ...]) -> ops_pb2.Value:
    top, *items = path
    v = call.kwargs[top] if isinstance(top, str) else call.args[top]  # type: ignore[index]
    for j in items:
        v = getattr(v, v.WhichOneof("kind")).items[j]  # type: ignore[arg-type]
    return v


def _expand(v: ops_pb2.Value, count: int, name: Callable[[int, int], int]) -> None:
    """A gathered list (recorded with iteration 0's tensor as its one item) with ``count``
    items, item ``i`` naming iteration ``i``'s tensor."""
    kind = v.WhichOneof("kind")
    items = getattr(v, kind).items if kind in ("list", "tuple") else ()
    if len(items) != 1 or items[0].WhichOneof("kind") != "tensor":
        raise ValueError("a gathered argument is not a list of one tensor")
    template = ops_pb2.Value()
    template.CopyFrom(items[0])
    del items[:]
    for i in range(count):
        item = items.add()
        item.CopyFrom(template)
        item.tensor.id = name(template.tensor.id, i)
