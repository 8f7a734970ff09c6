"""Unrolling a definition's loop (``rrtod.loops``): iteration ``i`` is the recorded body with its
own ids, its index set to ``i``; a gathered list gets one item per iteration; the head is the
unrolled definition's first calls exactly; what a loop may read is checked."""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import pytest

from rrto.v1 import ops_pb2
from rrtod.gpu.replay import compile_sequence
from rrtod.loops import (
    SKIP,
    VARIANT_SLOTS,
    app_positions,
    bodies,
    check,
    choose,
    choose_known,
    counted_by,
    guard_locals,
    guards,
    head,
    iteration_start,
    layout_of,
    samples,
    unroll,
)
from rrtod.wire import iter_tensor_refs
from testkit.loopdefs import branched, call, same_compiled, tensor

SRC = ops_pb2.SeqSource


def looped() -> ops_pb2.SequenceDef:
    """keep = nonzero(x) -> 10;  buf = zeros -> 11;  for i in range(len(keep)):
    row = keep.select(0, i) -> 20;  buf.add_(row) -> 11 (in place);  v = row * 2 -> 21;
    then out = stack([v for each i]) -> 30.  Outputs: out and buf."""
    d = ops_pb2.SequenceDef(id=5, thread=1, local_ids=[10, 11, 20, 21, 30], outputs=[30, 11])
    x = ops_pb2.Value(tensor=ops_pb2.TensorRef(upload=ops_pb2.TensorData(
        meta=ops_pb2.TensorMeta(dtype="float32", shape=[4]))))
    d.calls.extend([
        call("aten::nonzero", [10], x),
        call("aten::zeros", [11], ops_pb2.Value(i=3)),
        call("aten::select.int", [20], tensor(10), ops_pb2.Value(i=0), ops_pb2.Value(i=0)),
        call("aten::add_.Tensor", [11], tensor(11), tensor(20)),
        call("aten::mul.Scalar", [21], tensor(20), ops_pb2.Value(i=2)),
        call("aten::stack", [30], ops_pb2.Value(list=ops_pb2.ValueList(items=[tensor(21)]))),
    ])
    d.sources.add(kind=SRC.INPUT)
    for rid in (10, 11, 20, 20, 21):
        d.sources.add(kind=SRC.PRODUCED, id=rid)
    d.symbols.add(call=2, arg=2, index=True)
    loop = d.loops.add(start=2, body=3, tensor=10, dim=0)
    loop.gathers.add(call=5, arg=0)
    d.varies_from = 0
    return d


def test_each_iteration_gets_its_index_and_ids_and_the_gather_one_item_each():
    u = unroll(looped(), 3)
    assert [c.op for c in u.calls] == ["aten::nonzero", "aten::zeros",
                                       *["aten::select.int", "aten::add_.Tensor",
                                         "aten::mul.Scalar"] * 3, "aten::stack"]
    selects = [c for c in u.calls if c.op == "aten::select.int"]
    assert [c.args[2].i for c in selects] == [0, 1, 2]
    rows = [c.out_ids[0] for c in selects]
    assert rows[0] == 20 and len(set(rows)) == 3
    for c, row in zip([c for c in u.calls if c.op == "aten::mul.Scalar"], rows, strict=True):
        assert c.args[0].tensor.id == row  # each iteration reads its own row...
    for c in u.calls:
        if c.op == "aten::add_.Tensor":
            assert c.out_ids[0] == 11 and c.args[0].tensor.id == 11  # ...and writes the buffer
    products = [c.out_ids[0] for c in u.calls if c.op == "aten::mul.Scalar"]
    assert [v.tensor.id for v in u.calls[-1].args[0].list.items] == products
    assert not u.loops and not u.symbols
    # sources line up with the refs, in order, and name what each ref names
    refs = [r for c in u.calls for r in iter_tensor_refs(c)]
    assert len(refs) == len(u.sources)
    assert all(s.id == r.id for s, r in zip(u.sources, refs, strict=True)
               if s.kind == SRC.PRODUCED)
    assert len(set(u.local_ids)) == len(u.local_ids) == 2 + 2 * 3 + 1
    assert list(u.outputs) == [30, 11]
    compile_sequence(u)  # consistent for the host


def test_no_iteration_leaves_the_calls_around_the_loop():
    u = unroll(looped(), 0)
    assert [c.op for c in u.calls] == ["aten::nonzero", "aten::zeros", "aten::stack"]
    assert len(u.calls[-1].args[0].list.items) == 0
    assert len(u.sources) == 1 + 0  # the input; the empty list reads nothing
    compile_sequence(u)


def test_the_head_is_the_first_calls_of_every_unrolling():
    d = looped()
    h = head(d)
    assert counted_by(d) == (0, 0)
    assert not h.outputs  # nothing pushed before the loop is known
    for n in (0, 1, 4):
        u = unroll(d, n)
        assert list(u.calls[: len(h.calls)]) == list(h.calls)
        assert list(u.local_ids[: len(h.local_ids)]) == list(h.local_ids)
        assert list(u.sources[: len(h.sources)]) == list(h.sources)
    compile_sequence(h)


def test_later_loops_move_along_and_varies_from_follows():
    d = looped()
    d.varies_from = 4  # in the body: every iteration's copy from there on varies
    assert unroll(d, 2).varies_from == 4
    d.varies_from = 5  # after the loop: moved by the extra iterations
    assert unroll(d, 4).varies_from == 5 + 3 * 3
    assert unroll(d, 0).varies_from == 2


@pytest.mark.parametrize("breaks", ["fresh input in body", "suffix reads an iteration",
                                    "count made in the loop", "index outside a loop",
                                    "gather of a constant"])
def test_what_unrolling_cannot_keep_equal_is_refused(breaks):
    d = looped()
    if breaks == "fresh input in body":
        d.sources[3].kind = SRC.INPUT
    elif breaks == "suffix reads an iteration":
        del d.loops[0].gathers[:]
    elif breaks == "count made in the loop":
        d.loops[0].tensor = 21
    elif breaks == "index outside a loop":
        d.symbols.add(call=1, arg=0, index=True)
    else:
        d.sources[5].kind, d.sources[5].id = SRC.CONSTANT, 99
    with pytest.raises(ValueError):
        check(d)
        unroll(d, 2)


def test_each_slot_says_which_recorded_slot_it_comes_from():
    """A weight read in the loop (slot 3 made ``PERSISTENT``) is the same recorded slot in
    every iteration: both ends bind it once under that slot (``origins``)."""
    d = looped()
    d.sources[3].kind, d.sources[3].hash = SRC.PERSISTENT, b"w" * 16
    origins: list[int] = []
    u = unroll(d, 2, origins)
    assert origins == [0, 1, 2, 3, 4, 1, 2, 3, 4, 5, 5]
    assert [u.sources[s].kind for s, o in enumerate(origins) if o == 3] == [SRC.PERSISTENT] * 2
    origins0: list[int] = []
    unroll(d, 0, origins0)
    assert origins0 == [0]


def scattered() -> ops_pb2.SequenceDef:
    """classes = unique(x) -> 10;  (c0, c1, ...) = unbind(classes) -> 12 (recorded: one
    output);  for c in ...:  m = eq(x, c) -> 20;  buf.add_(m) -> 11;  then out = buf * 2 -> 30.
    Outputs: out."""
    d = ops_pb2.SequenceDef(id=6, thread=1, local_ids=[10, 11, 12, 20, 30], outputs=[30])
    x = ops_pb2.Value(tensor=ops_pb2.TensorRef(upload=ops_pb2.TensorData(
        meta=ops_pb2.TensorMeta(dtype="float32", shape=[4]))))
    d.calls.extend([
        call("aten::_unique2", [10], x),
        call("aten::zeros", [11], ops_pb2.Value(i=4)),
        call("aten::unbind.int", [12], tensor(10)),
        call("aten::eq.Tensor", [20], tensor(10), tensor(12)),
        call("aten::add_.Tensor", [11], tensor(11), tensor(20)),
        call("aten::mul.Scalar", [30], tensor(11), ops_pb2.Value(i=2)),
    ])
    d.calls[2].out_meta.add(dtype="int64")
    d.sources.add(kind=SRC.INPUT)
    for rid in (10, 10, 12, 11, 20, 11):
        d.sources.add(kind=SRC.PRODUCED, id=rid)
    d.loops.add(start=3, body=2, tensor=10, dim=0, scatters=[2])
    return d


def test_a_scattered_call_makes_one_output_per_iteration_each_read_by_its_own():
    """``for c in torch.unique(x)``: the ``unbind`` before the loop is recorded with iteration
    0's output only; unrolled it makes ``count``, and iteration ``i`` reads output ``i``. The
    head ends before it (its outputs are as many as the count)."""
    d = scattered()
    assert len(head(d).calls) == 2 and counted_by(d) == (0, 0)
    for n in (0, 1, 3):
        u = unroll(d, n)
        unbind = u.calls[2]
        assert len(unbind.out_ids) == len(unbind.out_meta) == n
        assert list(unbind.out_ids[:1]) == [12][:n] and len(set(unbind.out_ids)) == n
        eqs = [c for c in u.calls if c.op == "aten::eq.Tensor"]
        assert [c.args[1].tensor.id for c in eqs] == list(unbind.out_ids)
        assert len(set(u.local_ids)) == len(u.local_ids) == 3 + 2 * n
        assert list(u.calls[:2]) == list(head(d).calls)
        compile_sequence(u)


@pytest.mark.parametrize("breaks", ["scatter after the loop start", "two outputs",
                                    "read after the loop", "count made by the scatter"])
def test_a_scatter_that_cannot_be_unrolled_is_refused(breaks):
    d = scattered()
    if breaks == "scatter after the loop start":
        d.loops[0].scatters[:] = [3]
    elif breaks == "two outputs":
        d.calls[2].out_ids.append(13)
    elif breaks == "read after the loop":
        d.calls[5].args[0].tensor.id = 12
        d.sources[6].id = 12
    else:
        d.loops[0].tensor = 12
    with pytest.raises(ValueError):
        check(d)


def test_each_iteration_makes_its_body_then_the_variant_its_guards_chose():
    d = branched()
    check(d)
    assert choose(d.loops[0], [(True,), (0,), (1.0,)]) == [0, 1, 0]
    u = unroll(d, 3, choices=[0, 1, 0])
    body = ["aten::select.int", "aten::gt.Scalar"]
    assert [c.op for c in u.calls] == ["aten::nonzero", *body, "aten::mul.Scalar", *body,
                                       "aten::neg", "aten::add.Scalar", *body,
                                       "aten::mul.Scalar", "aten::sum"]
    rows = [c.out_ids[0] for c in u.calls if c.op == "aten::select.int"]
    assert [c.args[2].i for c in u.calls if c.op == "aten::select.int"] == [0, 1, 2]
    assert [c.args[0].tensor.id for c in u.calls
            if c.op in ("aten::mul.Scalar", "aten::neg")] == rows  # each its own row
    ys = [u.calls[3].out_ids[0], u.calls[7].out_ids[0], u.calls[10].out_ids[0]]
    assert u.calls[7].args[0].tensor.id == u.calls[6].out_ids[0]
    assert len(set(ys)) == 3 and not {30, 31, 32} & set(u.local_ids)  # always renamed
    gs = guards(d, 3)
    assert [g for (g,) in gs] == [c.out_ids[0] for c in u.calls if c.op == "aten::gt.Scalar"]
    assert set(u.outputs) == {40, *(g for (g,) in gs), *ys}
    assert len(set(u.local_ids)) == len(u.local_ids) == 1 + 2 * 3 + 1 + 2 + 1 + 1
    refs = [r for c in u.calls for r in iter_tensor_refs(c)]
    assert len(refs) == len(u.sources) and all(
        s.id == r.id for s, r in zip(u.sources, refs, strict=True) if s.kind == SRC.PRODUCED)
    compile_sequence(u)


def test_the_host_runs_every_body_first_and_names_the_same_ids_at_the_same_indices():
    """The host's order: all bodies (``bodies``: what it runs before it reads the guards),
    then all variants. Its local ids are the app order's, index for index; only the calls'
    order differs, and each call reads what it reads in the app's order."""
    d = branched()
    app = unroll(d, 3, choices=[1, 0, 1])
    host = unroll(d, 3, choices=[1, 0, 1], bodies_first=True)
    first = bodies(d, 3)
    assert [c.op for c in first.calls] == ["aten::nonzero",
                                           *["aten::select.int", "aten::gt.Scalar"] * 3]
    assert list(host.calls[: len(first.calls)]) == list(first.calls)
    assert list(host.local_ids[: len(first.local_ids)]) == list(first.local_ids)
    assert list(host.local_ids) == list(app.local_ids) and not first.outputs
    assert sorted(map(str, host.calls)) == sorted(map(str, app.calls))
    assert set(host.outputs) == set(app.outputs)
    for u in (app, host, first):
        compile_sequence(u)
    origins: list[int] = []
    unroll(d, 2, origins, choices=[1, 0])
    # head (1), body (2), variant 1 (slots 5, 6: after d's 4 and variant 0's 1), body, v0 (4)
    v = VARIANT_SLOTS + (1 << 24)  # variant 0's one slot, then variant 1's two
    assert origins == [0, 1, 2, v + 1, v + 2, 1, 2, v, 3]


def test_the_guards_local_indices_are_worked_out_without_unrolling():
    """``guard_locals``: where each iteration's guards sit among the local ids of the bodies
    (and of every unrolling with the bodies first), for any count, as ``bodies`` lays them
    out."""
    d = branched()
    for count in range(6):
        local = {rid: i for i, rid in enumerate(bodies(d, count).local_ids)}
        want = [[local.get(g, -1) for g in gs] for gs in guards(d, count)]
        assert guard_locals(d, count) == want == guard_locals(d, count, layout_of(d))
        assert all(i >= 0 for gs in want for i in gs)
    d.loops[0].guards.append(d.calls[0].out_ids[0])  # a value of the head: no iteration's
    assert all(gs[-1] == -1 for gs in guard_locals(d, 3))


@pytest.mark.parametrize("breaks", ["no choices", "a value no variant has", "guard not made",
                                    "body writes in place", "variant writes what the body reads",
                                    "same values twice", "values per guard",
                                    "suffix reads a variant's value", "variant reads a fresh input"])
def test_variants_that_cannot_be_chosen_or_reordered_are_refused(breaks):
    d = branched()
    loop = d.loops[0]
    if breaks == "no choices":
        with pytest.raises(ValueError):
            unroll(d, 2)
        return
    if breaks == "a value no variant has":
        with pytest.raises(ValueError):
            choose(loop, [(1,), (2,)])
        return
    if breaks == "guard not made":
        loop.guards[:] = [10]
    elif breaks == "body writes in place":
        d.calls[2].out_ids[:] = [10]
    elif breaks == "variant writes what the body reads":
        loop.variants[0].calls[0].out_ids[:] = [20]
    elif breaks == "same values twice":
        loop.variants[1].when[:] = [1.0]
    elif breaks == "values per guard":
        loop.variants[1].when.append(1.0)
    elif breaks == "suffix reads a variant's value":
        d.calls[3].args[0].tensor.id = 30
        d.sources[3].id = 30
    else:
        loop.variants[1].sources[0].kind = SRC.INPUT
    with pytest.raises(ValueError):
        check(d)
        unroll(d, 2, choices=[0, 1])


def test_each_call_of_the_hosts_order_knows_its_place_in_the_apps():
    d = branched()
    choices = [1, 0, 1]
    app = unroll(d, 3, choices=choices)
    host = unroll(d, 3, choices=choices, bodies_first=True)
    where = app_positions(d, 3, choices)
    assert sorted(where) == list(range(len(app.calls)))
    assert all(host.calls[k] == app.calls[a] for k, a in enumerate(where))
    for u in samples(d):
        compile_sequence(u)


def test_the_samples_a_host_checks_hold_each_variant_alone_and_after_the_one_before_it():
    """Defining a loop with ``k`` variants compiles ``k + 3`` samples (was ``3k + 1``): no
    iteration, each variant alone (the first and the last iteration), and one chain
    0, 1, ..., k-1, 0 in the app's order and the host's, in which each variant follows the
    one before it, as the pairs it replaces had them."""
    d = branched()
    third = d.loops[0].variants.add(when=[2.0], local_ids=[33], outputs=[33])
    third.calls.append(call("aten::abs", [33], tensor(20)))
    third.sources.add(kind=SRC.PRODUCED, id=20)
    k = len(d.loops[0].variants)
    chain = [0, 1, 2, 0]
    got = samples(d)
    assert got == [unroll(d, 0, choices=[]), *(unroll(d, 1, choices=[v]) for v in range(k)),
                   unroll(d, 4, choices=chain), unroll(d, 4, choices=chain, bodies_first=True)]
    assert {(a, b) for a, b in pairwise(chain)} == {(v, (v + 1) % k) for v in range(k)}
    for u in got:
        compile_sequence(u)


def test_an_unrolling_cut_at_a_branch_no_variant_has_ends_after_that_iterations_body():
    """Iteration ``k`` read values no variant has (``choose_known`` stops there): both ends
    unroll the head, the ``k`` iterations before it and its body (``cut``), the host with
    every body first. The host's calls are the app's, each at its app position; the bodies
    after the cut are past the app's last call. Local ids are laid out as uncut; the outputs
    are those of the calls the app's order has."""
    d = branched()
    assert choose_known(d.loops[0], iter([(1.0,), (0.0,), (5.0,), (1.0,)])) == [0, 1]
    full = unroll(d, 4, choices=[1, 0, 1, 0])
    for k in range(4):
        choices = [1, 0, 1][:k]
        app = unroll(d, 4, choices=choices, cut=True)
        host = unroll(d, 4, choices=choices, cut=True, bodies_first=True)
        assert host == unroll(d, 4, choices=choices, cut=True, bodies_first=True,
                              bodies=bodies(d, 4))
        n = len(app.calls)
        assert n == 1 + 2 * (k + 1) + sum(len(d.loops[0].variants[c].calls) for c in choices)
        assert list(app.calls) == list(unroll(d, 4, choices=[*choices, 0, 0, 0, 0][:4]).calls[:n])
        where = app_positions(d, 4, choices)
        assert len(where) == len(host.calls) == 1 + 2 * 4 + n - 1 - 2 * (k + 1)
        assert sorted(a for a in where if a < n) == list(range(n))
        assert all(host.calls[j] == app.calls[a] for j, a in enumerate(where) if a < n)
        assert list(app.local_ids) == list(host.local_ids)
        assert list(app.local_ids) == list(full.local_ids)[: len(app.local_ids)]
        made = {r for c in app.calls for r in c.out_ids}
        assert set(app.outputs) == set(full.outputs) & made == set(host.outputs)
        assert not app.loops and app.varies_from == 1
        compile_sequence(app)
        compile_sequence(host)
    assert unroll(d, 2, choices=[1, 0], cut=True) == unroll(d, 2, choices=[1, 0])
    with pytest.raises(ValueError):
        unroll(d, 3, choices=[1])  # fewer choices, not asked to cut
    with pytest.raises(ValueError):
        unroll(looped(), 3, choices=None, cut=True)  # no variants: nothing to cut at


def test_a_cut_unrolling_resumes_at_the_next_iteration_with_the_same_ids():
    """After a cut at iteration ``k`` the app runs that iteration's branch by forwarding; a
    replay resumed at iteration ``k + 1`` (``ordered``) has ``SKIP`` for ``k``: no variant
    calls. In the app's order its calls before the resume point are the cut unrolling's, and
    after it those of any uncut unrolling past iteration ``k``. The host runs the iterations
    before it in the app's order, then every later body, then their variants (a copy of the
    bodies it ran: ``bodies=``); each of its calls is the app's at the position
    ``app_positions`` gives, also when the resumed replay is cut again. The local ids are
    laid out as in every other unrolling, so the values made before the resume point keep
    their indices."""
    d = branched()
    variants = d.loops[0].variants
    for k in range(4):
        done = [1, 0, 1][:k] + [SKIP]
        cut = unroll(d, 4, choices=done[:-1], cut=True)
        p = iteration_start(d, done)
        assert p == len(cut.calls)
        for rest in ([0, 1, 1][: 3 - k], [1, 1, 0][: 3 - k]):
            choices = done + rest
            app = unroll(d, 4, choices=choices)
            assert list(app.calls[:p]) == list(cut.calls)
            other = unroll(d, 4, choices=done[:-1] + [0] + rest)
            assert list(app.calls[p:]) == list(other.calls[p + len(variants[0].calls):])
            host = unroll(d, 4, choices=choices, bodies_first=True, ordered=k + 1, cut=True)
            if k < 3:  # (resumed after the last iteration: nothing to run first)
                stage = unroll(d, 4, choices=done, bodies_first=True, ordered=k + 1)
                assert list(stage.calls[:p]) == list(app.calls[:p]) and not stage.outputs
                assert len(stage.calls) == p + 2 * (3 - k)
                assert host == unroll(d, 4, choices=choices, bodies_first=True, ordered=k + 1,
                                      bodies=stage, cut=True)
            where = app_positions(d, 4, choices, ordered=k + 1)
            assert sorted(where) == list(range(len(app.calls)))
            assert all(host.calls[j] == app.calls[a] for j, a in enumerate(where))
            assert list(host.local_ids) == list(app.local_ids)
            assert list(app.local_ids)[: len(cut.local_ids)] == list(cut.local_ids)
            assert set(app.outputs) == set(host.outputs)
            compile_sequence(app)
            compile_sequence(host)
            if rest:  # cut again at the first iteration after the resumed one
                again = unroll(d, 4, choices=choices[: k + 2], cut=True)
                back = unroll(d, 4, choices=choices[: k + 2], bodies_first=True,
                              ordered=k + 1, bodies=stage, cut=True)
                where = app_positions(d, 4, choices[: k + 2], ordered=k + 1)
                n = len(again.calls)
                assert sorted(a for a in where if a < n) == list(range(n))
                assert all(back.calls[j] == again.calls[a] for j, a in enumerate(where)
                           if a < n)
    with pytest.raises(ValueError):
        unroll(d, 4, choices=[1], ordered=2, bodies_first=True)  # fewer choices than in order
    with pytest.raises(ValueError):
        unroll(d, 4, choices=[1, SKIP], ordered=2)  # in order: the host's, bodies first


@pytest.mark.parametrize("make", [looped, scattered, branched])
def test_an_unrolling_compiled_on_its_head_is_the_one_compiled_whole(make):
    """``compile_sequence(prefix=)``: an unrolling begins with the calls its head (or its
    bodies) ran; taking what those calls alone decide from the head's compile gives what
    compiling it all again gives, and stops sharing where a call differs (a scattered
    call's outputs follow the count)."""
    d = make()
    first = head(d)
    for n in (0, 1, 3):
        variants = bool(d.loops[0].variants)
        steps = [(first, dict(bodies_first=variants))]
        if variants:
            steps.append((bodies(d, n), dict(choices=[k % 2 for k in range(n)],
                                             bodies_first=True)))
        for before, how in steps:
            u = unroll(d, n, layout=layout_of(d), **how)
            assert u == unroll(d, n, **how)  # the layout is what ``unroll`` works out
            prefix = compile_sequence(before)
            whole, shared = compile_sequence(u), compile_sequence(u, prefix=prefix)
            assert not same_compiled(whole, shared), same_compiled(whole, shared)
            if "choices" in how:  # the host's way: a copy of the bodies, compiled on them
                copy = unroll(d, n, layout=layout_of(d), bodies=before, **how)
                assert copy == u
                on = compile_sequence(copy, prefix=prefix, copied=len(before.calls))
                assert not same_compiled(whole, on), same_compiled(whole, on)
                assert on.shared == len(before.calls)
            same = 0
            while same < min(len(u.calls), len(before.calls)) and \
                    u.calls[same] == before.calls[same]:
                same += 1
            assert shared.shared == same and whole.shared == 0


def test_each_unrolled_call_names_the_recorded_call_it_is_made_from():
    """``made_from``: the host keeps one decoded form per recorded call for all unrollings,
    so the key must be the same exactly for the same call whatever its ids: the loop's index
    among its arguments is part of it, and a call after the loop carries the count (a
    gathered list has one item per iteration)."""
    d = branched()
    made: list = []
    u = unroll(d, 3, choices=[0, 1, 0], made_from=made)
    assert made == [None, ("body", 0, 0), ("body", 1), ("variant", 0, 0),
                    ("body", 0, 1), ("body", 1), ("variant", 1, 0), ("variant", 1, 1),
                    ("body", 0, 2), ("body", 1), ("variant", 0, 0), ("after", 3, 3)]
    for key in {k for k in made if k is not None}:
        calls = [c for k, c in zip(made, u.calls, strict=True) if k == key]
        for c in calls:  # the same call but for its ids
            for c2 in calls:
                a, b = ops_pb2.OpCall(), ops_pb2.OpCall()
                a.CopyFrom(c)
                b.CopyFrom(c2)
                for x in (a, b):
                    del x.out_ids[:]
                    for ref in iter_tensor_refs(x):
                        ref.id = 0
                assert a == b, key
    first = bodies(d, 3)
    host: list = []
    copy = unroll(d, 3, choices=[0, 1, 0], bodies_first=True, bodies=first, made_from=host)
    assert host[:len(first.calls)] == [None] * len(first.calls)
    assert sorted(map(str, host[len(first.calls):])) == sorted(
        map(str, [k for k in made if k is not None and k[0] != "body"]))
    assert len(host) == len(copy.calls)


def test_bodies_of_another_count_are_not_copied():
    """``unroll(bodies=)`` continues from the bodies the caller ran only when they are
    ``bodies(d, count)``: bodies of another count are refused, not unrolled wrong."""
    d = branched()
    for other in (2, 4):
        with pytest.raises(ValueError, match="not its bodies"):
            unroll(d, 3, choices=[0, 1, 0], bodies_first=True, bodies=bodies(d, other))
    done = unroll(d, 3, choices=[0, 1, 0], bodies_first=True)
    with pytest.raises(ValueError, match="not its bodies"):  # a whole unrolling, not bodies
        unroll(d, 3, choices=[0, 1, 0], bodies_first=True, bodies=done)


def test_a_prefix_that_differs_is_not_shared():
    d = looped()
    u = unroll(d, 2)
    other = head(d)
    other.calls[1].args[0].i = 4  # zeros(4): not the unrolling's first calls any more
    assert compile_sequence(u, prefix=compile_sequence(other)).shared == 1
    other.local_ids[0] = 99
    assert compile_sequence(u, prefix=compile_sequence(other)).shared == 0


@pytest.mark.parametrize("make", [looped, scattered, branched])
def test_the_shims_unrolling_shares_its_heads_steps_and_matches_the_same(make):
    """The shim's unrolling (``_unrolled``) takes the head's steps as they are (with the
    plans their replays worked out) and compiles the rest: what it matches equals a
    compile of the whole unrolling."""
    from rrto_plugins.torch.replay import Step, _unrolled
    from rrto_plugins.torch.replay import compile_sequence as shim_compile

    d = make()
    head_seq = shim_compile(d)
    for n in (0, 1, 3):
        choices = [k % 2 for k in range(n)] if d.loops[0].variants else None
        got = _unrolled(head_seq, n, choices)
        whole = shim_compile(unroll(d, n, choices=choices), check=False)
        assert len(got.steps) == len(whole.steps)
        for a, b in zip(got.steps, whole.steps, strict=True):
            assert [f.name for f in dataclasses.fields(Step) if f.name != "built"
                    and repr(getattr(a, f.name)) != repr(getattr(b, f.name))] == []
        for f in ("local", "last_writer", "outputs", "chain", "sized", "valued"):
            assert getattr(got, f) == getattr(whole, f), f
        shared = sum(1 for a, b in zip(got.steps, head_seq.steps, strict=False) if a is b)
        assert shared == len(head(d).calls)
