// distvals._core.shuffle_order: the order in which Dataset.shuffle's streaming buffer
// gives a pass's elements (distvals.data._shuffled_order draws the random numbers; this
// walks the buffer). The walk is inherently sequential, one buffer slot per element,
// and in Python it cost about half a second per million elements at every pass's start.
#include <cstdint>
#include <string>
#include <vector>

#include "bindings.hpp"

namespace distvals_py {
namespace {

using index_array = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;

// `draw` must be a slot of a buffer of `slots`: numpy's draws always are, but an
// index out of range here would read past the buffer, so every draw is checked.
void check_draw(std::int64_t draw, std::int64_t slots, std::int64_t at) {
  if (draw < 0 || draw >= slots) {
    throw py::value_error("shuffle_order: draw " + std::to_string(at) + " is " + std::to_string(draw) +
                          ", not a slot of a buffer of " + std::to_string(slots));
  }
}

// The n = size + len(full) elements through a buffer of `size` slots:
// 1. while the source lasts (one draw of `full` per element past the buffer's first
//    fill) the buffer is full: the drawn slot's element goes out and the source's next
//    element (numbered from `size` on) takes its place;
// 2. once the source has ended, draw i of `tail` picks among the size - i elements
//    left: the picked one goes out and the last one moves into its slot.
py::array_t<std::int64_t> shuffle_order(const index_array& full, const index_array& tail, std::int64_t size) {
  if (size < 0) throw py::value_error("shuffle_order: size must be at least 0, got " + std::to_string(size));
  if (full.ndim() != 1 || tail.ndim() != 1) throw py::value_error("shuffle_order: draws must be 1-d");
  if (tail.shape(0) != size) {
    throw py::value_error("shuffle_order: " + std::to_string(tail.shape(0)) + " tail draws for a buffer of " +
                          std::to_string(size) + " slots");
  }
  const std::int64_t n_full = full.shape(0);
  py::array_t<std::int64_t> out(n_full + size);
  const std::int64_t* f = full.data();
  const std::int64_t* t = tail.data();
  std::int64_t* o = out.mutable_data();
  {
    nogil unlocked;  // the arrays stay referenced by the caller's frame
    std::vector<std::int64_t> buf(static_cast<std::size_t>(size));
    for (std::int64_t s = 0; s < size; ++s) buf[static_cast<std::size_t>(s)] = s;
    // 1. The full buffer.
    for (std::int64_t k = 0; k < n_full; ++k) {
      const std::int64_t j = f[k];
      check_draw(j, size, k);
      o[k] = buf[static_cast<std::size_t>(j)];
      buf[static_cast<std::size_t>(j)] = size + k;
    }
    // 2. The draining buffer: the last element left fills the slot given out.
    for (std::int64_t i = 0; i < size; ++i) {
      const std::int64_t j = t[i];
      const std::int64_t left = size - i;
      check_draw(j, left, n_full + i);
      o[n_full + i] = buf[static_cast<std::size_t>(j)];
      buf[static_cast<std::size_t>(j)] = buf[static_cast<std::size_t>(left - 1)];
    }
  }
  return out;
}

}  // namespace

void register_shuffle(py::module_& m) {
  m.def("shuffle_order", &shuffle_order, py::arg("full"), py::arg("tail"), py::arg("size"),
        "The order of a pass through Dataset.shuffle's buffer of `size` slots, given the "
        "draws while the source lasts (`full`) and after it ends (`tail`, one per slot).");
}

}  // namespace distvals_py
