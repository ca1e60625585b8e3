"""The resident programs' labels (engine/resident.py): an eviction reports the labels it dropped, never takes a
label being loaded or kept, and `touch` tells which labels lost a program; and what `fallback.CompiledShapes` does
with that report: the shape stops being usable, steps pad to a loaded one, and the background loads it again only
once a padded step wants it. Pure bookkeeping: stand-in jit objects, nothing compiles."""
from __future__ import annotations

from engine_util import small_config, tiny_model
from jaxserve.engine import Engine
from jaxserve.engine.fallback import CompiledShapes
from jaxserve.engine.resident import Resident
from jaxserve.engine.sampling_forms import SERVING_MODES

CFG = small_config(kv_dtype="fp8", max_batch=4, max_model_len=64, prefill_chunk=32, max_prefill_tokens=32)


class _Jit:
    """Stands in for one jit object: counts `clear_cache` calls."""

    def __init__(self) -> None:
        self.cleared = 0

    def clear_cache(self) -> None:
        self.cleared += 1


def _load(resident: Resident, label: object, *sigs: object) -> list[_Jit]:
    with resident.labelled(label):
        return [resident.get(("decode", None, (sig,)), _Jit) for sig in sigs]


def test_evictions_report_their_labels_and_spare_loading_and_kept_ones():
    r = Resident()
    told: list[tuple[list, bool]] = []
    r.on_drop = lambda labels, everything: told.append((labels, everything))
    a, = _load(r, "a", 1)
    b1, b2 = _load(r, "b", 2, 3)
    _load(r, "kept", 4)
    r.keep(["kept"])
    r.get(("decode", None, (5,)), _Jit)  # unlabelled: dropped without a report
    r.tick = 10
    with r.labelled("c"):
        r.get(("decode", None, (6,)), _Jit)
        # everything is old; only the label in flight and the kept one stay
        assert r.evict(lambda: len(r) > 0, keep_since=10) == 4
    assert told == [(["a"], False), (["b"], False), (["b"], False)]
    assert a.cleared == b1.cleared == b2.cleared == 1 and len(r) == 2
    assert r.touch(["a", "kept", "c", "never seen"]) == ["a"]
    _load(r, "a", 1)  # loaded again: no longer gone
    assert r.touch(["a"]) == []
    told.clear()
    r.clear()  # after jax.clear_caches: every label is reported, and gone
    assert len(told) == 1 and told[0][1] and set(told[0][0]) == {"a", "kept", "c"} and len(r) == 0
    assert set(r.touch(["a", "kept", "c"])) == {"a", "kept", "c"}


def test_an_evicted_shape_pads_and_is_reloaded_only_when_wanted():
    e = Engine(tiny_model(), CFG, start=False)
    try:
        shapes = CompiledShapes(e.programs)
        r = e.programs.resident
        small, big = ("decode", 2, 8, 0), ("decode", 4, 16, 0)
        for b, m in ((2, 8), (4, 16)):  # as if compiled: each form's program loaded under its key
            for form in SERVING_MODES:
                _load(r, ("decode", b, m, 0, form), (b, m, form))
            shapes.add(("unpack", b, m, 0, ""))
            for form in SERVING_MODES:
                shapes.add(("decode", b, m, 0, form))
        assert {small, big} <= shapes.usable
        with shapes._lock:
            shapes._queue = [("decode", 1, 8, 0, "greedy")]  # a plan key left
        r.tick = 5
        r.evict(lambda: ("decode", 2, 8, 0, "greedy") not in r._gone, keep_since=5)  # the LRU one: small's
        assert small not in shapes.usable and ("decode", 2, 8, 0, "greedy") in shapes.evicted
        assert ("unpack", 2, 8, 0, "") in shapes.done  # not a resident program: still loaded
        # the plan key first; the evicted key waits for a padded step to want its shape
        assert shapes.next_key() == ("decode", 1, 8, 0, "greedy") and shapes.next_key() is None
        assert shapes.cover("decode", 2, 8) == (4, 16, 0) and shapes.demand(("decode", 2, 8, 0, "greedy")) == 1
        assert shapes.next_key() == ("decode", 2, 8, 0, "greedy") and shapes.next_key() is None
        _load(r, ("decode", 2, 8, 0, "greedy"), (2, 8, "greedy"))
        shapes.add(("decode", 2, 8, 0, "greedy"))
        assert small in shapes.usable and shapes.reloads == 1 and shapes.cover("decode", 2, 8) == (2, 8, 0)
        # an eviction the shapes have not been told of yet: `cover` finds it gone and pads past it
        r.on_drop = None
        r.tick = 9
        r.touch([(*big, form) for form in SERVING_MODES])  # big's programs used by the step now: kept
        r.evict(lambda: ("decode", 2, 8, 0, "any") not in r._gone, keep_since=9)
        assert small in shapes.usable and shapes.cover("decode", 1, 8) == (4, 16, 0) and small not in shapes.usable
    finally:
        e.close()


def test_clear_reports_labels_held_elsewhere_and_adopt_takes_a_cold_full_warm_ups_drops():
    """`clear` (after jax.clear_caches) also reports the labels loaded since the last clear whose programs are not held
    here (an unpacking, a tag sync); `CompiledShapes.adopt` then treats every dropped key of a cold full warm-up as
    evicted: its shape pads into a loaded one and waits for a step to want it, and the fast set's dropped keys load
    again at once (`_load`, stood in for here)."""
    r = Resident()
    with r.labelled("unpack"):  # no program held here
        pass
    _load(r, "decode", 1)
    r.clear()
    assert r.gone(["unpack", "decode", "never seen"]) == ["unpack", "decode"]
    with r.labelled("unpack"):  # loaded again
        pass
    assert r.gone(["unpack"]) == []

    e = Engine(tiny_model(), CFG, start=False)
    try:
        shapes = CompiledShapes(e.programs)
        r = e.programs.resident
        small, big = ("decode", 2, 8, 0), ("decode", 4, 16, 0)
        keys = [(*s, form) for s in (small, big) for form in SERVING_MODES] + \
            [("unpack", 2, 8, 0, ""), ("unpack", 4, 16, 0, "")]
        for k in keys:  # as the cold warm-up's labelled jobs would
            if k[0] == "decode":
                _load(r, k, k)
            else:
                with r.labelled(k):
                    pass
        r.tick = 5
        r.evict(lambda: ("decode", 2, 8, 0, "greedy") not in r._gone, keep_since=5)  # small's greedy program
        loaded: list = []
        shapes._load = lambda key, freeze: (loaded.append(key), shapes.add(key))  # the fast set's reloads
        shapes.adopt(keys)
        assert big in shapes.usable and small not in shapes.usable
        assert ("decode", 2, 8, 0, "greedy") in shapes.evicted and ("decode", 2, 8, 0, "any") in shapes.done
        assert loaded == [k for k in keys if k in loaded]  # nothing outside the plan
        assert shapes.next_key() is None  # the dropped key waits for demand ...
        assert shapes.cover("decode", 2, 8) == (4, 16, 0)  # ... while its steps pad into the loaded shape
        assert shapes.next_key() == ("decode", 2, 8, 0, "greedy")
    finally:
        e.close()


def test_a_load_is_not_a_use_so_a_warm_up_can_evict_by_recency_before_any_step():
    """Before any step (tick 0) a warm-up's loads are evictable least recently used first, where every program once
    counted as used by the current step and no eviction dropped anything (the bound then dropped every program:
    jax.clear_caches); a program a step ran stays within the recency bound, and one loaded again keeps its use."""
    r = Resident()
    _load(r, "old", 1)
    _load(r, "new", 2)
    stepped = r.get(("decode", None, ("step",)), _Jit)  # a step's call: no label
    assert r.evict(lambda: len(r) > 1, keep_since=-2) == 2  # the loads go, oldest first; the step's program stays
    assert r.gone(["old", "new"]) == ["old", "new"] and stepped.cleared == 0 and len(r) == 1
    r.tick = 3
    _load(r, "again", "step")  # a program a step used, reached again inside a load: it keeps that use
    assert r.evict(lambda: True, keep_since=0) == 0
