"""distvals.nest: flattening in tf.nest's order and packing back, checked against an
independent reference walk on random structures (flat dicts, the common case, take a
shortcut of their own)."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distvals import nest

Pair = collections.namedtuple("Pair", "first second")

leaves = st.integers(-5, 5) | st.none() | st.floats(allow_nan=False)
keys = st.text("abcxyz", min_size=1, max_size=3)
structures = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(keys, inner, max_size=4)
        | st.builds(Pair, inner, inner)
    ),
    max_leaves=12,
)


def reference_flatten(x):
    """tf.nest's order, written out plainly: dict values by sorted key, depth first."""
    if isinstance(x, dict):
        return [leaf for k in sorted(x) for leaf in reference_flatten(x[k])]
    if isinstance(x, (list, tuple)):
        return [leaf for item in x for leaf in reference_flatten(item)]
    return [x]


def same_shape_and_order(a, b):
    """Equal values, the same container types, and dicts in the same key order."""
    assert type(a) is type(b)
    if isinstance(a, dict):
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
