#include "distvals/buffer.hpp"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

namespace distvals {

void buffer::free_deleter::operator()(void* p) const noexcept { std::free(p); }

buffer::buffer(std::size_t count, dtype type) : count_(count), type_(type) {
  // 64-byte alignment keeps vector loads and cache lines aligned; aligned_alloc needs
  // a size that is a multiple of the alignment.
  // A size that does not fit in size_t (rounded up to the alignment) cannot be had.
  const std::size_t size = dtype_size(type);
  if (count > (SIZE_MAX - 63) / size) throw std::bad_alloc();
  const std::size_t bytes = count * size;
  const std::size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, rounded == 0 ? 64 : rounded);
  data_.reset(p);
}

}  // namespace distvals
