"""The iterators of ``distvals.data`` transformations that draw their elements from several
passes at once: ``interleave`` (a cycle of the passes its function makes),
``choose_from_datasets`` (the pass a choice dataset names) and ``sample_from_datasets``
(a pass drawn at random). As the other iterators (see ``data_iterators``), each is an
object whose state survives a failed element: the next ``next()`` goes on after it."""

from __future__ import annotations

import typing
from typing import Any, Callable, Iterator, List

import numpy as np


class InterleaveIterator:
    """tf.data's interleave order: ``cycle_length`` slots, each holding the pass of one
    source element. From the slot at the cycle's position come up to ``block_length``
    elements, then the cycle moves to the next slot. A pass that ends empties its slot
    and the cycle moves on; an empty slot is filled with the next source element's pass
    when the cycle reaches it, until the source ends. A failed element (of an inner pass,
    or a source element whose pass could not be made) fails its ``next()``; the position
    stays, so the next ``next()`` asks the same pass again (or the next source element)."""

    __slots__ = ("_block", "_block_length", "_ended", "_index", "_open", "_open_count", "_slots", "_source")

    def __init__(
        self,
        source: Iterator[Any],
        open_pass: Callable[[Any], Iterator[Any]],
        cycle_length: int,
        block_length: int,
    ) -> None:
        self._source = source
        self._open = open_pass
        self._slots: List[typing.Optional[Iterator[Any]]] = [None] * cycle_length
        self._block_length = block_length
        self._index = 0  # the slot the cycle is at
        self._block = 0  # elements taken from it in this turn
        self._open_count = 0
        self._ended = False

    def __iter__(self) -> Iterator[Any]:
        return self

    def _advance(self) -> None:
        self._block = 0
        self._index = (self._index + 1) % len(self._slots)

    def __next__(self) -> Any:
        while not self._ended or self._open_count > 0:
            it = self._slots[self._index]
            if it is not None:
                # 1. The slot's pass gives the next element (its turn ends after a block).
                try:
                    x = next(it)
                except StopIteration:
                    # 2. ... or has ended: the slot empties and the cycle moves on.
                    self._slots[self._index] = None
                    self._open_count -= 1
                    self._advance()
                    continue
                self._block += 1
                if self._block == self._block_length:
                    self._advance()
                return x
            if not self._ended:
                # 3. An empty slot takes the pass of the next source element, and the
                #    cycle stays there to read it.
                try:
                    element = next(self._source)
                except StopIteration:
                    self._ended = True
                    continue
                self._slots[self._index] = self._open(element)
                self._open_count += 1
            else:
                # 4. The source has ended: empty slots are passed over.
                self._advance()
        raise StopIteration


class ChooseIterator:
    """tf.data's directed interleave: each choice names the pass the next element comes
    from. A chosen pass that has ended ends everything (``stop_on_empty``), or is passed
    over (and the next choice read) until every pass has ended. ``choices`` yields ints;
    one out of range fails its ``next()``."""

    __slots__ = ("_choices", "_live", "_sources", "_stop_on_empty")

    def __init__(self, sources: List[Iterator[Any]], choices: Iterator[int], stop_on_empty: bool) -> None:
        self._sources: List[typing.Optional[Iterator[Any]]] = list(sources)
        self._choices: typing.Optional[Iterator[int]] = choices
        self._stop_on_empty = stop_on_empty
        self._live = len(sources)

    def __iter__(self) -> Iterator[Any]:
        return self

    def _end(self) -> typing.NoReturn:
        self._choices = None
        self._sources = [None] * len(self._sources)
        raise StopIteration

    def __next__(self) -> Any:
        while self._choices is not None:
            k = next(self._choices)  # StopIteration: no more choices, the end
            if not 0 <= k < len(self._sources):
                raise ValueError(
                    f"choose_from_datasets: the choice {k} is out of range for {len(self._sources)} datasets"
                )
            it = self._sources[k]
            if it is None:
                continue  # an ended pass chosen again: the next choice
            try:
                return next(it)
            except StopIteration:
                pass
            if self._stop_on_empty:
                self._end()
            self._sources[k] = None
            self._live -= 1
            if self._live == 0:
                self._end()
        raise StopIteration


class SampleIterator:
    """Each element from a pass drawn at random with the given weights. A pass that ends
    ends everything (``stop_on_empty``) or leaves the draw: the others are drawn in
    proportion to their weights (as tf.data, which draws again until it hits one that has
    not ended). When no pass of positive weight is left, the iteration ends."""

    __slots__ = ("_generator", "_rng", "_sources", "_stop_on_empty", "_weights")

    def __init__(
        self,
        sources: List[Iterator[Any]],
        weights: np.ndarray,
        generator: Callable[[], np.random.Generator],
        stop_on_empty: bool,
    ) -> None:
        self._sources: List[typing.Optional[Iterator[Any]]] = list(sources)
        self._weights = np.array(weights, dtype=np.float64)
        self._generator = generator
        self._rng: typing.Optional[np.random.Generator] = None
        self._stop_on_empty = stop_on_empty

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._rng is None:
            self._rng = self._generator()  # at the pass's first element, as shuffle's
        while True:
            total = self._weights.sum()
            if not total > 0:
                raise StopIteration
            k = int(self._rng.choice(len(self._weights), p=self._weights / total))
            it = self._sources[k]
            assert it is not None  # an ended pass has weight 0
            try:
                return next(it)
            except StopIteration:
                pass
            if self._stop_on_empty:
                self._weights[:] = 0
                raise StopIteration
            self._sources[k] = None
            self._weights[k] = 0
