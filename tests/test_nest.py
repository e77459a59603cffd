"""distvals.nest: flattening in tf.nest's order and packing back, checked against an
independent reference walk on random structures (flat dicts, the common case, take a
shortcut of their own; mappings that are not dicts a path of their own)."""

from __future__ import annotations

import collections
import collections.abc
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distvals import nest

Pair = collections.namedtuple("Pair", "first second")


class _Items:
    """The read-only mapping protocol over a dict of its own."""

    def __init__(self, items):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


class Frozen(_Items, collections.abc.Mapping):
    """A Mapping that is not a dict (as flax's FrozenDict or immutabledict are)."""

    def __repr__(self):
        return f"Frozen({self._items!r})"


class Registered(_Items):
    """A class registered with Mapping, not derived from it."""

    def keys(self):
        return self._items.keys()

    def items(self):
        return self._items.items()


collections.abc.Mapping.register(Registered)

leaves = st.integers(-5, 5) | st.none() | st.floats(allow_nan=False)
keys = st.text("abcxyz", min_size=1, max_size=3)
structures = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(keys, inner, max_size=4)
        | st.dictionaries(keys, inner, max_size=4).map(Frozen)
        | st.dictionaries(keys, inner, max_size=3).map(types.MappingProxyType)
        | st.builds(Pair, inner, inner)
    ),
    max_leaves=12,
)


def reference_flatten(x):
    """tf.nest's order, written out plainly: a mapping's values by sorted key, depth first."""
    if isinstance(x, collections.abc.Mapping):
        return [leaf for k in sorted(x) for leaf in reference_flatten(x[k])]
    if isinstance(x, (list, tuple)):
        return [leaf for item in x for leaf in reference_flatten(item)]
    return [x]


def same_shape_and_order(a, b):
    """Equal values, the same container types, and mappings in the same key order."""
    assert type(a) is type(b)
    if isinstance(a, collections.abc.Mapping):
        assert list(a) == list(b)
        for k in a:
            same_shape_and_order(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same_shape_and_order(x, y)
    else:
        assert a == b or (a is None and b is None)


@settings(max_examples=300, deadline=None)
@given(structures)
def test_flatten_and_pack_round_trip(s):
    flat = nest.flatten(s)
    assert flat == reference_flatten(s)
    same_shape_and_order(nest.pack_sequence_as(s, flat), s)
    assert nest.structure_mismatch(s, s) is None
    # New leaves land where flatten found the old ones.
    tagged = nest.pack_sequence_as(s, [f"leaf{i}" for i in range(len(flat))])
    assert nest.flatten(tagged) == [f"leaf{i}" for i in range(len(flat))]


def test_a_flat_dict_flattens_by_sorted_key_and_packs_in_its_own_order():
    d = {"w2": 1, "b1": 2, "w1": 3, "b2": 4}
    assert nest.flatten(d) == [2, 4, 3, 1]  # b1, b2, w1, w2
    out = nest.pack_sequence_as(d, ["B1", "B2", "W1", "W2"])
    assert list(out) == ["w2", "b1", "w1", "b2"]
    assert out == {"w2": "W2", "b1": "B1", "w1": "W1", "b2": "B2"}


def test_a_dict_with_unsortable_keys_keeps_insertion_order():
    d = {2: "a", "x": "b", 1: "c"}
    assert nest.flatten(d) == ["a", "b", "c"]
    assert nest.pack_sequence_as(d, [10, 20, 30]) == {2: 10, "x": 20, 1: 30}


def test_a_dict_holding_a_container_is_walked():
    d = {"b": [1, 2], "a": 0}
    assert nest.flatten(d) == [0, 1, 2]
    assert nest.pack_sequence_as(d, [5, 6, 7]) == {"b": [6, 7], "a": 5}


def test_pack_with_the_wrong_number_of_leaves_is_an_error():
    with pytest.raises(ValueError, match="fewer leaves"):
        nest.pack_sequence_as({"a": 1, "b": [2, 3]}, [1, 2])
    with pytest.raises(ValueError, match="more leaves"):
        nest.pack_sequence_as({"a": 1, "b": 2}, [1, 2, 3])


def test_mismatches_of_flat_dicts_are_named():
    assert nest.structure_mismatch({"a": 1, "b": 2}, {"a": 3, "b": 4}) is None
    why = nest.structure_mismatch({"a": 1, "b": 2}, {"a": 1, "c": 2})
    assert why is not None and "dict keys" in why
    why = nest.structure_mismatch({"a": 1, "b": 2}, {"a": 1, "b": [2]})
    assert why == "at ['b']: a single value vs list of 1"


# ---- the walks in C++: the same answers as plain Python walks ---------------------------------


def nest_order(d):
    try:
        return sorted(d)
    except TypeError:
        return list(d)


def reference_same(a, b):
    """The nesting rules written out plainly: the same container types (any two lists
    and any two mappings match), lengths and mapping keys, leaves in the same places."""
    containers = (list, tuple, collections.abc.Mapping)
    a_nested, b_nested = isinstance(a, containers), isinstance(b, containers)
    if not a_nested or not b_nested:
        return a_nested == b_nested
    mappings = isinstance(a, collections.abc.Mapping) and isinstance(b, collections.abc.Mapping)
    if type(a) is not type(b) and not (isinstance(a, list) and isinstance(b, list)) and not mappings:
        return False
    if isinstance(a, collections.abc.Mapping):
        return nest_order(a) == nest_order(b) and all(reference_same(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(reference_same(x, y) for x, y in zip(a, b))


@settings(max_examples=400, deadline=None)
@given(structures, structures)
def test_same_nesting_agrees_with_a_plain_walk_and_names_every_difference(a, b):
    for x, y in ((a, b), (a, a), (b, a)):
        expected = reference_same(x, y)
        assert nest._same(x, y) is expected
        assert (nest.structure_mismatch(x, y) is None) is expected


def test_subclasses_keep_their_types_and_their_own_order():
    od = collections.OrderedDict([("b", 1), ("a", 2), ("c", 3)])
    od.move_to_end("b")  # iteration order a, c, b; the dict's storage order differs
    assert nest.flatten(od) == [2, 1, 3]  # sorted keys: a, b, c
    out = nest.pack_sequence_as(od, ["A", "B", "C"])
    assert type(out) is collections.OrderedDict and list(out) == ["a", "c", "b"]
    assert out == {"a": "A", "b": "B", "c": "C"}

    class Row(tuple):
        pass

    class Items(list):
        pass

    dd = collections.defaultdict(list, {"y": 1, "x": 2})
    s = [Row((1, 2)), Items([3]), Pair(4, 5), dd]
    packed = nest.pack_sequence_as(s, [10, 20, 30, 40, 50, 60, 70])
    assert [type(x) for x in packed] == [Row, Items, Pair, collections.defaultdict]
    assert packed[0] == (10, 20) and packed[1] == [30] and packed[2] == Pair(40, 50)
    assert dict(packed[3]) == {"x": 60, "y": 70}
    assert nest._same(s, packed) and not nest._same(s, [(1, 2), Items([3]), Pair(4, 5), dd])


def test_self_containing_and_very_deep_structures_are_a_recursion_error():
    loop: list = [1]
    loop.append(loop)
    with pytest.raises(RecursionError):
        nest.flatten(loop)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    for walk in (nest.flatten, lambda s: nest.pack_sequence_as(s, []), lambda s: nest._same(s, s)):
        with pytest.raises(RecursionError):
            walk(deep)


def test_a_key_comparison_that_fails_otherwise_than_type_error_is_raised():
    class Key:
        def __init__(self, k):
            self.k = k

        def __hash__(self):
            return hash(self.k)

        def __lt__(self, other):
            raise ArithmeticError(f"cannot order {self.k}")

    with pytest.raises(ArithmeticError, match="cannot order"):
        nest.flatten({Key(1): 1, Key(2): 2})


def test_pack_takes_any_sequence_of_leaves_and_refuses_other_things():
    assert nest.pack_sequence_as([1, (2,)], (7, 8)) == [7, (8,)]
    assert nest.pack_sequence_as({"a": 0}, range(5, 6)) == {"a": 5}
    with pytest.raises(TypeError, match="must be a sequence"):
        nest.pack_sequence_as([1], 5)


@settings(max_examples=200, deadline=None)
@given(structures, st.integers(1, 4), st.booleans())
def test_regroup_makes_the_same_per_replica_leaves_as_a_plain_walk(s, n, always_wrap):
    from distvals.values import PerReplica, regroup

    shared = object()
    # Replica r's copy of s: its leaves tagged with r, but the first leaf shared by all.
    count = len(nest.flatten(s))
    per = [nest.pack_sequence_as(s, [shared if i == 0 else f"{r}:{i}" for i in range(count)]) for r in range(n)]
    out = regroup(per, always_wrap=always_wrap)
    columns = list(zip(*[nest.flatten(p) for p in per]))
    got = nest.flatten(out)
    assert len(got) == len(columns)
    for leaf, column in zip(got, columns):
        if not always_wrap and all(c is column[0] for c in column):
            assert leaf is column[0]
        else:
            assert type(leaf) is PerReplica and leaf.values == column
    assert nest._same(out, s)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("always_wrap", [False, True])
def test_regroup_of_flat_dicts_by_name_keeps_replica_0s_keys_and_wraps_each_column(n, always_wrap):
    # Flat dicts with str keys in sorted order (the gradients a step returns by name) are
    # regrouped in one walk; keys written in another order, or a nested value, take the
    # general walk. Both give replica 0's dict, key by key, over every replica's leaves.
    import numpy as np

    from distvals import _core
    from distvals.values import Mirrored, PerReplica

    shared = object()
    for keys in (["a", "b", "c"], ["c", "a", "b"]):
        per = [
            {k: (shared if k == "b" else np.bool_(r % 2) if k == "c" else f"{k}{r}") for k in keys} for r in range(n)
        ]
        for cls in (PerReplica, Mirrored):  # each class's own slot
            out = _core.nest_regroup(per, cls, always_wrap)
            assert type(out) is dict and list(out) == keys
            for k in keys:
                column = tuple(p[k] for p in per)
                if k == "b" and not always_wrap:
                    assert out[k] is shared
                elif n == 1 and not always_wrap and k != "c":
                    assert out[k] is column[0]  # one replica's own leaf (a numpy bool is wrapped)
                else:
                    assert type(out[k]) is cls and out[k].values == column, (k, cls)


def test_regroup_names_the_replicas_whose_nestings_differ():
    from distvals.values import regroup

    with pytest.raises(ValueError, match=r"replicas 0 and 2 returned different structures \(at \['b'\]"):
        regroup([{"a": 1, "b": [2]}, {"a": 3, "b": [4]}, {"a": 5, "b": (6,)}])


@pytest.mark.parametrize(
    "a, b",
    [
        ({1: "one", "w": "dub"}, {"w": "dub", 1: "one"}),  # cannot be sorted: each its own order
        ({frozenset({1}): 1, frozenset({2}): 2}, {frozenset({2}): 2, frozenset({1}): 1}),  # no total order
    ],
    ids=["unsortable", "frozensets"],
)
def test_the_same_keys_in_orders_that_would_pair_other_leaves_are_a_mismatch(a, b):
    # Flattened, the leaves of a and b come in different key orders: pairing them by
    # position would reduce one key's values with another's.
    assert [a[k] for k in a] != nest.flatten(b) or nest.flatten(a) != nest.flatten(b)
    assert not nest._same(a, b) and not nest._same([a], [b])
    why = nest.structure_mismatch({"x": a}, {"x": b})
    assert why is not None and why.startswith("at ['x']: dict keys in another order")
    from distvals.values import regroup

    with pytest.raises(ValueError, match="dict keys in another order"):
        regroup([a, b])
    # The same insertion order is the same nesting, sortable keys or not.
    assert nest._same(a, dict(a)) and nest.structure_mismatch(a, dict(a)) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("execution", ["inline", "threads"])
def test_a_step_whose_replicas_order_unsortable_keys_differently_is_a_mismatch(execution):
    import numpy as np

    import distvals as dv

    strategy = dv.MirroredStrategy(["CPU:0", "CPU:1"], execution=execution)

    def fn():
        r = dv.get_replica_context().replica_id_in_sync_group
        one, w = np.full(2, 1.0 + r), np.full(2, 100.0 * (r + 1))
        value = {1: one, "w": w} if r == 0 else {"w": w, 1: one}
        return dv.get_replica_context().all_reduce("SUM", value)

    with pytest.raises(dv.MismatchError, match="dict keys in another order"):
        strategy.run(fn)
    strategy.close()


def test_a_key_comparison_that_changes_the_structure_is_an_error_not_a_crash():
    from distvals.values import regroup

    class Key:
        def __init__(self, k, hook=None):
            self.k, self.hook = k, hook

        def __hash__(self):
            return hash(self.k)

        def __eq__(self, other):
            return isinstance(other, Key) and other.k == self.k

        def __lt__(self, other):
            if self.hook is not None:
                hook, self.hook = self.hook, None
                hook()
            return self.k < other.k

    # pack: a key added to the dict while its keys are sorted (sorting two keys compares
    # the second with the first): the walk packs the keys it found.
    d: dict = {}
    d[Key(2)] = 2
    d[Key(1, lambda: d.__setitem__(Key(0), 0))] = 1
    out = nest.pack_sequence_as(d, [10, 20])
    assert [(k.k, v) for k, v in out.items()] == [(2, 20), (1, 10)]
    # regroup: a list of the second replica emptied while that replica's keys are sorted
    items = [1, 2, 3]
    shrinking = {Key(2): items, Key(1, items.clear): 0}
    with pytest.raises(ValueError, match="changed while it was being walked"):
        regroup([{Key(2): [1, 2, 3], Key(1): 0}, shrinking])


def test_nesting_deeper_than_the_walks_allow_is_a_recursion_error_even_with_a_raised_limit():
    import sys

    deep: list = []
    for _ in range(20_000):
        deep = [deep]
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(10**6)
    try:
        with pytest.raises(RecursionError):
            nest.flatten(deep)
    finally:
        sys.setrecursionlimit(old)


def test_layout_writes_out_every_container_kind_and_key():
    """Two values have equal layouts exactly when their nestings are equal: list against
    tuple, keys, namedtuple fields and depth all show."""
    Pair = collections.namedtuple("Pair", ["x", "y"])
    assert nest.layout({"b": [1, (2,)], "a": 3}) == "{'a': *, 'b': [*, (*,)]}"
    assert nest.layout(Pair(1, [2])) == "Pair(x=*, y=[*])"
    assert nest.layout(5) == "*"
    differing = [[1, [2]], [1, (2,)], [1, {"k": 2}], [1, {"j": 2}], [1, 2], [[1, 2]], Pair(1, 2), (1, 2), {}]
    layouts = [nest.layout(v) for v in differing]
    assert len(set(layouts)) == len(differing), layouts
    # The same verdict as the in-process comparison, on every pair.
    for a in differing:
        for b in differing:
            same = nest.structure_mismatch(a, b) is None
            assert same == (nest.layout(a) == nest.layout(b)), (a, b)


# ---- container kinds, as tf.nest counts them -----------------------------------------------


def test_namedtuples_of_one_name_and_fields_are_one_kind(execution):
    # A namedtuple class made anew in each replica's function (or each step) is the same
    # structure, as in tf.nest; other fields are not, and the message says which.
    import numpy as np

    import distvals as dv

    s = dv.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"], execution=execution)

    def step(fields):
        r = dv.get_replica_context().replica_id_in_sync_group
        Out = collections.namedtuple("Out", fields(r))
        return dv.get_replica_context().all_reduce("SUM", Out(np.float32(r), np.array([1.0 * r])))

    out = s.run(step, args=(lambda r: "loss grad",))
    assert type(out).__name__ == "Out" and out._fields == ("loss", "grad")
    for r in range(3):
        assert float(out.loss.values[r]) == 3.0 and out.grad.values[r].tolist() == [3.0]
    with pytest.raises(dv.MismatchError, match=r"Out\(loss, grad\) namedtuple vs Out\(loss, grads\) namedtuple"):
        s.run(step, args=(lambda r: "loss grad" if r < 2 else "loss grads",))
    assert nest.structure_mismatch(collections.namedtuple("P", "x")(1), collections.namedtuple("Q", "x")(1))


def test_any_two_dicts_are_one_kind_and_dict_subclasses_keep_what_they_hold(execution):
    import numpy as np

    import distvals as dv
    from distvals.values import select_replica

    s = dv.MirroredStrategy(["CPU:0", "CPU:1"], execution=execution)

    class Tagged(dict):
        def __init__(self, tag):
            super().__init__()
            self.tag = tag

    def step():
        r = dv.get_replica_context().replica_id_in_sync_group
        kind = dict if r == 0 else collections.OrderedDict
        d = collections.defaultdict(list, a=np.array([1.0 + r]))
        t = Tagged("grads")
        t["w"] = np.array([10.0 * (r + 1)])
        return dv.get_replica_context().all_reduce("SUM", {"plain": kind(b=np.array([r])), "dd": d, "t": t})

    out = s.run(step)
    for r in range(2):
        mine = select_replica(r, out)
        assert mine["plain"]["b"].tolist() == [1]
        assert mine["dd"].default_factory is list and mine["dd"]["a"].tolist() == [3.0]
        assert mine["t"].tag == "grads" and mine["t"]["w"].tolist() == [30.0]


def test_a_container_whose_constructor_takes_other_arguments_keeps_its_leaves():
    class Tagged(list):
        def __init__(self, tag, items=()):
            super().__init__(items)
            self.tag = tag

    out = nest.pack_sequence_as(Tagged("t", [1, 2]), [5, 6])
    assert type(out) is Tagged and out == [5, 6] and out.tag == "t"

    class Pair(tuple):
        def __new__(cls, tag, items=()):
            return super().__new__(cls, items)

    with pytest.raises(TypeError, match=r"Pair rebuilt from its 2 items does not hold them"):
        nest.pack_sequence_as(Pair("t", (1, 2)), [5, 6])


def test_any_mapping_is_walked_by_sorted_key_and_rebuilt_with_its_own_class():
    proxy = types.MappingProxyType({"w": 1, "b": [2, 3]})
    assert nest.is_nested(proxy) and nest.is_mapping(proxy) and nest.is_mapping(Registered({}))
    assert not nest.is_mapping([1]) and not nest.is_nested(object())
    assert nest.flatten(proxy) == [2, 3, 1]  # b, then w
    out = nest.pack_sequence_as(proxy, [20, 30, 10])
    assert type(out) is types.MappingProxyType and list(out) == ["w", "b"] and dict(out) == {"w": 10, "b": [20, 30]}

    reg = Registered({"z": 1, "a": {"k": 2}})
    assert nest.flatten(reg) == [2, 1]
    out = nest.pack_sequence_as(reg, ["A", "Z"])
    assert type(out) is Registered and list(out) == ["z", "a"] and out["a"] == {"k": "A"} and out["z"] == "Z"
    assert nest.paths(reg) == ["['a']['k']", "['z']"]
    assert nest.layout(Frozen({"b": 1, "a": (2,)})) == "{'a': (*,), 'b': *}" == nest.layout({"a": (3,), "b": 4})


def test_any_two_mappings_are_one_kind_and_their_differences_are_named():
    assert nest.structure_mismatch(Frozen({"a": 1}), {"a": 2}) is None
    assert nest.structure_mismatch(types.MappingProxyType({"a": [1]}), Frozen({"a": [2]})) is None
    why = nest.structure_mismatch(Frozen({"a": 1, "b": 2}), {"a": 1, "c": 2})
    assert why == "at the top level: mapping keys [\"'a'\", \"'b'\"] vs [\"'a'\", \"'c'\"]"
    assert nest.structure_mismatch({"x": Frozen({"a": 1})}, {"x": Frozen({"a": [1]})}) == (
        "at ['x']['a']: a single value vs list of 1"
    )
    assert nest.structure_mismatch(Frozen({"a": 1}), [1]) == "at the top level: Frozen of 1 vs list of 1"


def test_a_mapping_whose_class_takes_no_dict_is_named_when_it_is_rebuilt():
    class Keyed(Frozen):
        def __init__(self, tag, items=()):
            super().__init__(items)
            self.tag = tag

    with pytest.raises(TypeError, match=r"Keyed \(a Mapping\) called with a dict of its 2 items does not make one"):
        nest.pack_sequence_as(Keyed("t", {"a": 1, "b": 2}), [5, 6])


@pytest.mark.parametrize("execution", ["inline", "threads"])
def test_a_step_all_reduces_and_returns_mappings_that_are_not_dicts(execution):
    import numpy as np

    import distvals as dv
    from distvals.values import PerReplica, select_replica

    n = 3
    s = dv.MirroredStrategy([f"CPU:{i}" for i in range(n)], execution=execution)

    def grads(r):
        return {"w": np.arange(4.0) * (r + 1), "b": np.array([10.0**r])}

    def step(scale):
        r = dv.get_replica_context().replica_id_in_sync_group
        g = types.MappingProxyType(grads(r)) if r != 1 else Frozen(grads(r))
        summed = dv.get_replica_context().all_reduce("SUM", g)
        return Frozen({"summed": summed, "mine": Frozen({"w": grads(r)["w"] * scale})})

    out = s.run(step, args=(dv.PerReplica(tuple(float(r + 2) for r in range(n))),))
    # The step's result is a mapping of PerReplica leaves, in replica 0's class.
    assert type(out) is Frozen and type(out["mine"]["w"]) is PerReplica
    want = {k: sum(np.asarray(grads(r)[k], np.float64) for r in range(n)) for k in ("w", "b")}
    for r in range(n):
        mine = select_replica(r, out)
        assert type(mine["summed"]) is types.MappingProxyType
        for k in ("w", "b"):
            np.testing.assert_array_equal(mine["summed"][k], want[k])
        np.testing.assert_array_equal(mine["mine"]["w"], grads(r)["w"] * (r + 2))
    total = s.reduce("SUM", out["mine"], axis=None)
    np.testing.assert_array_equal(total["w"], sum(grads(r)["w"] * (r + 2) for r in range(n)))


def test_keys_that_print_alike_but_differ_are_named_so():
    nan = float("nan")
    why = nest.structure_mismatch({nan: [1]}, {float("nan"): [1]})
    assert "dict keys ['nan'] vs ['nan'] (keys that print alike but are not equal, such as NaN" in why


def test_merge_call_arguments_of_different_structures_say_so(execution):
    import numpy as np

    import distvals as dv

    s = dv.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"], execution=execution)

    def step():
        r = dv.get_replica_context().replica_id_in_sync_group
        kwargs = {"a": np.ones(1)} if r < 2 else {"a": np.ones(1), "b": np.ones(1)}
        return dv.get_replica_context().merge_call(lambda strategy, **kw: 0, kwargs=kwargs)

    with pytest.raises(ValueError, match=r"merge_call: replicas 0 and 2 passed different structures as kwargs"):
        s.run(step)
