/// @file
/// Buffers: typed views of memory, and owning host buffers.
///
/// Nothing here synchronizes: a view or a buffer may be used from any thread, but
/// the memory itself must not be written by one thread while a collective reads or
/// writes it from another.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "distvals/device.hpp"
#include "distvals/dtype.hpp"
#include "distvals/export.hpp"

namespace distvals {

/// A non-owning view of `count` contiguous elements of type `type` on `dev`.
/// Cheap to copy; the memory must outlive every collective that uses it.
/// A plain aggregate: building or copying one never throws; any thread.
struct buffer_view {
  /// First element; may be null only when `count` is 0.
  void* data = nullptr;
  /// Number of elements (not bytes).
  std::size_t count = 0;
  /// Element type.
  dtype type = dtype::float32;
  /// Where the memory lives; host memory ("CPU:0") unless set.
  device dev{};

  /// Size in bytes, count · dtype_size(type). Never throws; any thread.
  std::size_t bytes() const noexcept { return count * dtype_size(type); }
};

/// A float16 element as its IEEE binary16 bits (C++17 has no half type); for typed views.
struct float16_bits {
  std::uint16_t bits;  ///< sign, 5 exponent bits, 10 mantissa bits
};
/// A bfloat16 element as its bits (the upper half of a float32); for typed views.
struct bfloat16_bits {
  std::uint16_t bits;  ///< sign, 8 exponent bits, 7 mantissa bits
};

/// The dtype of element type T: float, double, std::int8_t, std::uint8_t, std::int32_t,
/// std::int64_t, float16_bits or bfloat16_bits (a compile error for anything else).
template <class T>
constexpr dtype dtype_of() noexcept {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) {
    return dtype::float32;
  } else if constexpr (std::is_same_v<U, double>) {
    return dtype::float64;
  } else if constexpr (std::is_same_v<U, std::int8_t>) {
    return dtype::int8;
  } else if constexpr (std::is_same_v<U, std::uint8_t>) {
    return dtype::uint8;
  } else if constexpr (std::is_same_v<U, std::int32_t>) {
    return dtype::int32;
  } else if constexpr (std::is_same_v<U, std::int64_t>) {
    return dtype::int64;
  } else if constexpr (std::is_same_v<U, float16_bits>) {
    return dtype::float16;
  } else if constexpr (std::is_same_v<U, bfloat16_bits>) {
    return dtype::bfloat16;
  } else {
    static_assert(sizeof(U) == 0, "distvals::view: no dtype for this element type");
    return dtype::float32;
  }
}

/// A view of `count` elements at `data`, its dtype deduced from T, so that it always
/// matches the pointer: `view(grads.data(), grads.size())`. `dev` says where the memory
/// lives (host memory unless given; device{device::kind_t::gpu, k} for CUDA device k).
/// A const pointer is for inputs, which the collectives only read. Never throws.
template <class T>
buffer_view view(T* data, std::size_t count, device dev = {}) noexcept {
  return buffer_view{const_cast<std::remove_const_t<T>*>(data), count, dtype_of<T>(), dev};
}

/// An owning buffer of host memory, 64-byte aligned. Move-only.
/// Any thread may create or destroy one; it is not synchronized.
class DISTVALS_EXPORT buffer {
 public:
  /// An empty buffer: no memory, count() == 0. Never throws; any thread.
  buffer() = default;
  /// Allocates `count` elements of `type` in host memory, zero-filled.
  /// Throws std::bad_alloc when memory is short. Any thread.
  buffer(std::size_t count, dtype type);
  /// Takes over `other`'s memory, leaving it empty. Never throws; any thread.
  buffer(buffer&&) noexcept = default;
  /// Frees this buffer's memory and takes over `other`'s. Never throws; any thread.
  buffer& operator=(buffer&&) noexcept = default;

  /// A view of the whole buffer, valid while the buffer lives. Never throws; any thread.
  buffer_view view() const noexcept { return {data_.get(), count_, type_, device{}}; }
  /// The first byte; null for an empty buffer. Never throws; any thread.
  void* data() const noexcept { return data_.get(); }
  /// Number of elements. Never throws; any thread.
  std::size_t count() const noexcept { return count_; }
  /// Element type. Never throws; any thread.
  dtype type() const noexcept { return type_; }
  /// Size in bytes (without the padding to 64 bytes). Never throws; any thread.
  std::size_t bytes() const noexcept { return count_ * dtype_size(type_); }
  /// Typed pointer; no check that T matches the dtype. Never throws; any thread.
  template <class T>
  T* as() const noexcept { return static_cast<T*>(data_.get()); }

 private:
  struct free_deleter {
    void operator()(void* p) const noexcept;
  };
  std::unique_ptr<void, free_deleter> data_;
  std::size_t count_ = 0;
  dtype type_ = dtype::float32;
};

}  // namespace distvals
