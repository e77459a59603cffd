/// @file
/// Buffers: typed views of memory, and owning host buffers.
#pragma once

#include <cstddef>
#include <memory>

#include "distvals/device.hpp"
#include "distvals/dtype.hpp"
#include "distvals/export.hpp"

namespace distvals {

/// A non-owning view of `count` contiguous elements of type `type` on `dev`.
/// Cheap to copy; the memory must outlive every collective that uses it.
struct buffer_view {
  void* data = nullptr;
  std::size_t count = 0;
  dtype type = dtype::float32;
  device dev{};

  std::size_t bytes() const noexcept { return count * dtype_size(type); }
};

/// An owning buffer of host memory, 64-byte aligned. Move-only.
/// Any thread may create or destroy one; it is not synchronized.
class DISTVALS_EXPORT buffer {
 public:
  buffer() = default;
  /// Allocates `count` elements of `type` in host memory, zero-filled.
  /// Throws std::bad_alloc when memory is short.
  buffer(std::size_t count, dtype type);
  buffer(buffer&&) noexcept = default;
  buffer& operator=(buffer&&) noexcept = default;

  /// A view of the whole buffer.
  buffer_view view() const noexcept { return {data_.get(), count_, type_, device{}}; }
  void* data() const noexcept { return data_.get(); }
  std::size_t count() const noexcept { return count_; }
  dtype type() const noexcept { return type_; }
  std::size_t bytes() const noexcept { return count_ * dtype_size(type_); }
  /// Typed pointer; no check that T matches the dtype.
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
