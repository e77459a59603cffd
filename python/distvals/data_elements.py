"""The elements of ``distvals.data`` datasets: their structure (as in tf.data, tuples,
namedtuples and dicts nest; a list is one component), the conversion of what users give
to numpy arrays, and the stacking of elements into batches."""

from __future__ import annotations

import typing
from typing import Any, List

import numpy as np

from . import nest
from ._convert import as_numpy

_INT32 = np.iinfo(np.int32)

# As in tf.data, tuples (namedtuples too) and dicts are structures; a list is one
# component, converted to an array.


def is_structure(x: Any) -> bool:
    return isinstance(x, (tuple, dict))


def flatten(x: Any) -> List[Any]:
    if isinstance(x, tuple):
        return [leaf for item in x for leaf in flatten(item)]
    if isinstance(x, dict):
        return [leaf for k in nest._sorted_keys(x) for leaf in flatten(x[k])]
    return [x]


def pack(template: Any, leaves: List[Any]) -> Any:
    it = iter(leaves)

    def build(t: Any) -> Any:
        if isinstance(t, tuple):
            items = [build(v) for v in t]
            return type(t)(*items) if hasattr(type(t), "_fields") else type(t)(items)
        if isinstance(t, dict):
            values = {k: build(t[k]) for k in nest._sorted_keys(t)}
            return type(t)((k, values[k]) for k in t)
        return next(it)

    return build(template)


def python_numbers(x: Any) -> bool:
    """True for Python numbers and (nested) lists and tuples of only them."""
    if isinstance(x, (list, tuple)):
        return all(python_numbers(v) for v in x)
    return isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic)


def is_dataset(x: Any) -> bool:
    """Whether ``x`` is a ``distvals.data.Dataset`` (an element may hold datasets, as
    ``window``'s do; this module cannot import that class)."""
    return getattr(type(x), "_is_dataset", False)


def convert_leaf(x: Any, what: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "dtype"):
        # numpy scalars and tensors of other libraries keep their dtype. (A torch
        # tensor's numpy view also stops resize_ from moving its memory under it.)
        return as_numpy(x)
    a = np.asarray(x)
    if a.dtype == np.float64 and python_numbers(x):
        # Python floats become float32, as in TensorFlow; numpy float64 values in a list
        # keep their dtype there too.
        return a.astype(np.float32)
    if (
        a.dtype.kind == "i"
        and a.dtype.itemsize > 4
        and (a.size == 0 or (a.min() >= _INT32.min and a.max() <= _INT32.max))
        and python_numbers(x)
    ):
        # Python ints become int32 where they fit, as in TensorFlow; numpy int64 values
        # in a list keep their dtype.
        return a.astype(np.int32)
    if a.dtype == object:
        raise TypeError(f"{what}: cannot make an array of {x!r}; nested lists must be rectangular")
    return a


def convert_element(x: Any, what: str, copy: bool = False) -> Any:
    """An element (a leaf or a nested structure) with every leaf converted to an array
    (with ``copy``, arrays of its own, never the caller's)."""
    # (A dataset stays one: a map function may return datasets, as in tf.data.)
    leaves = [v if is_dataset(v) else convert_leaf(v, what) for v in flatten(x)]
    if copy:
        leaves = [
            np.array(a, copy=True) if not is_dataset(a) and shares(a, v) else a for a, v in zip(leaves, flatten(x))
        ]
    return pack(x, leaves) if is_structure(x) else leaves[0]


def numpy_dtype(t: Any) -> np.dtype:
    # tf.DType objects say their numpy dtype; anything numpy understands is taken as is.
    dtype: np.dtype = np.dtype(getattr(t, "as_numpy_dtype", t))
    return dtype


def shares(a: np.ndarray, source: Any) -> bool:
    """Whether array ``a``, converted from ``source``, may use ``source``'s memory (it is
    ``source``, or a view of someone's buffer: a DLPack or buffer-protocol export)."""
    return a is source or not a.flags.owndata


def conform(x: Any, spec: Any) -> Any:
    """Generator element ``x`` in the structure, dtypes and shapes of ``spec``."""
    if type(x) is list and type(spec) is tuple:
        x = tuple(x)
    leaf_specs = flatten(spec)
    if not same_structure(x, spec):
        raise TypeError(
            f"from_generator: the generator yielded an element of structure {structure_text(x)} where the "
            f"output signature is {structure_text(spec)}"
        )
    leaves = flatten_up_to(spec, x)
    out = []
    for i, (v, sp) in enumerate(zip(leaves, leaf_specs)):
        try:
            # A copy: the generator may yield one buffer again and again. A string keeps
            # its own width (a signature's width cut longer strings short).
            a = np.array(v, dtype=sp.dtype.kind if sp.dtype.kind in "SU" else sp.dtype, copy=True)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(
                f"from_generator: component {i} of an element cannot be converted to {sp.dtype}: {e}"
            ) from None
        if sp.shape is not None and (
            a.ndim != len(sp.shape) or any(d is not None and d != n for d, n in zip(sp.shape, a.shape))
        ):
            raise ValueError(
                f"from_generator: component {i} of an element has shape {a.shape}, which does not fit the "
                f"output signature's {sp.shape}"
            )
        out.append(a)
    return pack(spec, out) if is_structure(spec) else out[0]


def same_structure(x: Any, spec: Any) -> bool:
    """Whether ``x`` nests like ``spec`` (tuples of the same length, dicts of the same
    keys; a list is one component, as everywhere in this module). A leaf of ``spec``
    takes any value, converted to an array (a tuple of numbers too, as tf.data does)."""
    if isinstance(spec, tuple):
        return isinstance(x, tuple) and len(x) == len(spec) and all(map(same_structure, x, spec))
    if isinstance(spec, dict):
        return isinstance(x, dict) and set(x) == set(spec) and all(same_structure(x[k], spec[k]) for k in spec)
    return True


def flatten_up_to(spec: Any, x: Any) -> List[Any]:
    """The leaves of ``x`` at the places of ``spec``'s leaves (``x`` nests like it)."""
    if isinstance(spec, tuple):
        return [leaf for s, v in zip(spec, x) for leaf in flatten_up_to(s, v)]
    if isinstance(spec, dict):
        return [leaf for k in nest._sorted_keys(spec) for leaf in flatten_up_to(spec[k], x[k])]
    return [x]


def structure_text(x: Any) -> str:
    if isinstance(x, tuple):
        return "(" + ", ".join(structure_text(v) for v in x) + ("," if len(x) == 1 else "") + ")"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {structure_text(x[k])}" for k in x) + "}"
    return "*"


def stack(elements: List[Any]) -> Any:
    """``elements`` stacked into one batch (a new first axis per component). Elements of
    one component must have one shape and dtype, as in tf.data (numpy would widen mixed
    dtypes, so that the batch's dtype differed from ``element_spec``'s, and its shape
    error names neither the component nor the shapes)."""
    first = elements[0]
    if not is_structure(first):
        return _stacked([np.asarray(e) for e in elements], 0)
    columns = zip(*(flatten(e) for e in elements))
    return pack(first, [_stacked([np.asarray(v) for v in col], i) for i, col in enumerate(columns)])


def _stacked(arrays: List[np.ndarray], component: int) -> np.ndarray:
    a0 = arrays[0]
    shape, dtype = a0.shape, a0.dtype
    for k, a in enumerate(arrays):
        if a.shape != shape:
            raise ValueError(
                f"batch: cannot batch elements of different shapes in component {component}: the first element "
                f"has shape {shape}, element {k} has shape {a.shape} (padded_batch pads them to one shape)"
            )
        if a.dtype != dtype and not same_dtype(a.dtype, dtype):
            raise TypeError(
                f"batch: cannot batch elements of different dtypes in component {component}: the first element "
                f"has dtype {dtype}, element {k} has dtype {a.dtype}"
            )
    return np.stack(arrays)


def copy_element(x: Any) -> Any:
    """``x`` with every leaf an array of its own."""
    leaves = [a if is_dataset(a) else np.array(a, copy=True) for a in flatten(x)]
    return pack(x, leaves) if is_structure(x) else leaves[0]


def bool_scalar(value: Any, what: str) -> bool:
    """A predicate's result as a bool: it must be a bool scalar (Python's, numpy's, or a
    0-d array or tensor of bool), as tf.data's ``tf.bool`` scalar."""
    a = value if isinstance(value, np.ndarray) else convert_leaf(value, what)
    if a.dtype != np.bool_ or a.shape != ():
        raise ValueError(
            f"{what}: the predicate must return a bool scalar, but it returned {a.dtype} of shape {a.shape}"
        )
    return bool(a)


def same_dtype(x: np.dtype, y: np.dtype) -> bool:
    """Whether ``x`` and ``y`` are one element dtype: equal, or numpy strings of one kind
    (``str`` or ``bytes``) whatever their widths (tf.data's one ``tf.string``)."""
    return x == y or (x.kind == y.kind and x.kind in "SU")


def merged_spec(a: Any, b: Any, what: str) -> Any:
    """The spec that elements of both ``a`` and ``b`` fit (each dimension kept where the
    two agree, None where they differ; the rank unknown where it differs); TypeError when
    their structures or dtypes differ."""
    from .specs import TensorSpec

    leaves_a, leaves_b = flatten(a), flatten(b)
    if not same_structure(a, b) or not same_structure(b, a) or len(leaves_a) != len(leaves_b):
        raise TypeError(f"{what}: incompatible dataset elements: {a} vs. {b}")
    out = []
    for x, y in zip(leaves_a, leaves_b):
        if not same_dtype(x.dtype, y.dtype):
            raise TypeError(f"{what}: incompatible dataset elements: {a} vs. {b}")
        dtype = np.promote_types(x.dtype, y.dtype)  # the wider of two string widths
        if x.shape is None or y.shape is None or len(x.shape) != len(y.shape):
            out.append(TensorSpec(None, dtype))
        else:
            out.append(TensorSpec(tuple(d if d == e else None for d, e in zip(x.shape, y.shape)), dtype))
    return pack(a, out) if is_structure(a) else out[0]


def padding_value(value: Any, dtype: np.dtype, where: str) -> np.ndarray:
    """``padded_batch``'s padding value for a component of ``dtype``: its zero (False,
    an empty string) for None; a Python number that ``dtype`` holds exactly; otherwise a
    scalar of that very dtype."""
    if value is None:
        return np.zeros((), dtype)
    if isinstance(value, (bool, int, float, complex, str, bytes)):
        try:
            # A string keeps its own width (the component's may be narrower: "PAD" into
            # one of 2-character strings was cut to "PA").
            v = np.array(value, dtype=dtype.kind if dtype.kind in "SU" else dtype)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(f"padded_batch: padding value {value!r} {where} cannot be a {dtype}: {e}") from None
        if v.dtype.kind not in "SUO" and v != value:
            raise TypeError(f"padded_batch: padding value {value!r} {where} is not exactly a {dtype} ({v})")
        return v
    v = convert_leaf(value, "padded_batch")
    if not same_dtype(v.dtype, dtype):
        raise TypeError(f"padded_batch: padding value {where} has dtype {v.dtype}; the component's is {dtype}")
    if v.shape != ():
        raise ValueError(f"padded_batch: padding value {where} must be a scalar, got shape {v.shape}")
    return v


def pad_stack(elements: List[Any], shapes: List[Any], values: List[Any], template: Any = None) -> Any:
    """``elements`` stacked into one batch, each component padded with its value in
    ``values`` to its shape in ``shapes`` (per leaf: None, or a tuple of sizes where
    None is the batch's largest); ValueError naming the component whose ranks differ
    or that is larger than its padded shape."""
    first = elements[0]
    columns = list(zip(*(flatten(e) for e in elements)))
    out = []
    for i, col in enumerate(columns):
        arrays = [np.asarray(v) for v in col]
        rank = arrays[0].ndim
        if any(a.ndim != rank for a in arrays):
            ranks = sorted({a.ndim for a in arrays})
            raise ValueError(f"padded_batch: component {i} has elements of different ranks {ranks} in one batch")
        if any(not same_dtype(a.dtype, arrays[0].dtype) for a in arrays):
            dtypes = sorted({str(a.dtype) for a in arrays})
            raise ValueError(f"padded_batch: component {i} has elements of different dtypes {dtypes} in one batch")
        # Strings: the widest of the elements' and the padding value's widths.
        dtype = arrays[0].dtype
        if dtype.kind in "SU":
            for d in {a.dtype for a in arrays} | {np.asarray(values[i]).dtype}:
                dtype = np.promote_types(dtype, d)
        largest = [max(a.shape[d] for a in arrays) for d in range(rank)]
        wanted = shapes[i]
        if wanted is None:
            target = largest
        else:
            if len(wanted) != rank:
                raise ValueError(
                    f"padded_batch: component {i} has rank {rank}; its padded shape {tuple(wanted)} has rank {len(wanted)}"
                )
            target = [largest[d] if wanted[d] is None else wanted[d] for d in range(rank)]
            for a in arrays:
                if any(n > t for n, t in zip(a.shape, target)):
                    raise ValueError(
                        f"padded_batch: component {i} of an element has shape {a.shape}, larger than its "
                        f"padded shape {tuple(target)}"
                    )
        batch = np.full([len(arrays), *target], values[i], dtype=dtype)
        for k, a in enumerate(arrays):
            where: typing.Tuple[Any, ...] = (k,) + tuple(slice(0, n) for n in a.shape)
            batch[where] = a
        out.append(batch)
    return pack(first, out) if is_structure(first) else out[0]
