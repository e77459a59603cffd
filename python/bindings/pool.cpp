// distvals._core.pooled_empty: numpy arrays whose memory is reused from step to step.
//
// Every collective inside strategy.run returns new arrays. Taken from malloc, a large
// result gets fresh pages from the kernel each step, and the first store to each page
// faults (zeroing it first): at 64 MiB that alone costs more than the collective. Here
// a block freed by Python (when its last array goes) is kept, already faulted in, and
// handed out again for the next request of the same size.
//
// Each array's base is a capsule over its block; the capsule's destructor returns the
// block. Free blocks are kept per size class up to a byte limit (DISTVALS_POOL_BYTES,
// default 1 GiB); a block that would go over it is freed at once, so resident memory
// stays bounded by what is in use plus the limit. Everything here runs with the GIL
// held (allocation from Python, capsule destructors), and a mutex guards the lists for
// any caller that does not.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "bindings.hpp"

namespace distvals_py {
namespace {

// Blocks start on a cache line; large ones on a page, so kernels and streaming stores
// see aligned rows. The header sits in the first bytes before the data.
constexpr std::size_t small_align = 64;
constexpr std::size_t page = 4096;
constexpr std::size_t large_block = 1 << 20;

struct header {
  std::size_t size_class;  // usable bytes of the block
  std::size_t offset;      // from the raw allocation to the data
};

std::size_t size_class_of(std::size_t bytes) {
  // Round up so that steps whose sizes differ a little share blocks: 64 bytes below
  // 64 KiB, then pages.
  if (bytes < (64u << 10)) return (bytes + small_align - 1) / small_align * small_align;
  return (bytes + page - 1) / page * page;
}

class host_pool {
 public:
  host_pool() {
    if (const char* env = std::getenv("DISTVALS_POOL_BYTES")) {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(env, &end, 10);
      if (end != env && *end == '\0') limit_ = static_cast<std::size_t>(v);
    }
  }

  // The data pointer of a block of at least `bytes` usable bytes.
  void* take(std::size_t bytes) {
    const std::size_t cls = size_class_of(std::max<std::size_t>(bytes, 1));
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = free_.find(cls);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_ -= cls;
        ++hits_;
        return p;
      }
      ++misses_;
    }
    const std::size_t align = cls >= large_block ? page : small_align;
    // The header takes one alignment unit in front of the data.
    void* raw = std::aligned_alloc(align, cls + align);
    if (raw == nullptr) throw std::bad_alloc();
    auto* data = static_cast<char*>(raw) + align;
    auto* h = reinterpret_cast<header*>(data) - 1;
    h->size_class = cls;
    h->offset = align;
    return data;
  }

  // Returns the block of `data`: kept when the limit allows, else freed.
  void give(void* data) noexcept {
    auto* h = static_cast<header*>(data) - 1;
    const std::size_t cls = h->size_class;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (cached_ + cls <= limit_) {
        try {
          free_[cls].push_back(data);
          cached_ += cls;
          return;
        } catch (...) {  // no memory for the list: free the block instead
        }
      }
    }
    std::free(static_cast<char*>(data) - h->offset);
  }

  // Frees every cached block.
  void trim() noexcept {
    std::unordered_map<std::size_t, std::vector<void*>> drop;
    {
      std::lock_guard<std::mutex> lk(mu_);
      drop.swap(free_);
      cached_ = 0;
    }
    for (auto& [cls, blocks] : drop) {
      for (void* data : blocks) {
        auto* h = static_cast<header*>(data) - 1;
        std::free(static_cast<char*>(data) - h->offset);
      }
    }
  }

  void set_limit(std::size_t bytes) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      limit_ = bytes;
      if (cached_ <= limit_) return;
    }
    trim();
  }

  py::dict stats() {
    std::lock_guard<std::mutex> lk(mu_);
    py::dict d;
    d["cached_bytes"] = cached_;
    d["limit_bytes"] = limit_;
    d["hits"] = hits_;
    d["misses"] = misses_;
    return d;
  }

 private:
  std::mutex mu_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;
  std::size_t cached_ = 0;
  std::size_t limit_ = std::size_t{1} << 30;
  std::uint64_t hits_ = 0, misses_ = 0;
};

// Never destroyed: capsules of arrays that outlive the module still return blocks.
host_pool& pool() {
  static auto* p = new host_pool();
  return *p;
}

py::array pooled_empty(const py::object& shape_obj, const py::object& dtype_obj) {
  const py::dtype dt = py::dtype::from_args(dtype_obj);
  std::vector<py::ssize_t> shape;
  if (py::isinstance<py::int_>(shape_obj)) {
    shape.push_back(shape_obj.cast<py::ssize_t>());
  } else {
    for (auto d : py::iterable(shape_obj)) shape.push_back(d.cast<py::ssize_t>());
  }
  std::size_t count = 1;
  for (auto d : shape) {
    if (d < 0) throw py::value_error("pooled_empty: negative dimension");
    count *= static_cast<std::size_t>(d);
  }
  if (dt.attr("hasobject").cast<bool>()) throw py::type_error("pooled_empty: object dtypes cannot be pooled");
  return pooled_array(dt, shape, count);
}

}  // namespace

py::array pooled_array(const py::dtype& dt, const std::vector<py::ssize_t>& shape, std::size_t count) {
  void* data = pool().take(count * static_cast<std::size_t>(dt.itemsize()));
  py::capsule owner(data, [](void* p) { pool().give(p); });
  return py::array(dt, shape, {}, data, owner);
}

py::array result_array(const py::dtype& dt, const std::vector<py::ssize_t>& shape, std::size_t count) {
  if (count * static_cast<std::size_t>(dt.itemsize()) >= pool_min_bytes) return pooled_array(dt, shape, count);
  return py::array(dt, shape);
}

py::object view_array(PyObject* descr, int ndim, const py::ssize_t* shape, void* data, const py::handle& base) {
  const auto& api = py::detail::npy_api::get();
  Py_INCREF(descr);  // the constructor takes a reference, even when it fails
  PyObject* a = api.PyArray_NewFromDescr_(api.PyArray_Type_, descr, ndim, const_cast<Py_intptr_t*>(shape), nullptr, data,
                                          py::detail::npy_api::NPY_ARRAY_WRITEABLE_, nullptr);
  if (a == nullptr) throw py::error_already_set();
  py::object out = py::reinterpret_steal<py::object>(a);
  if (api.PyArray_SetBaseObject_(a, base.inc_ref().ptr()) != 0) throw py::error_already_set();
  return out;
}

void register_pool(py::module_& m) {
  m.def("pooled_empty", &pooled_empty, py::arg("shape"), py::arg("dtype"),
        "An uninitialized C-contiguous array whose memory comes from (and returns to) the "
        "host pool, so results of repeated steps reuse pages that are already mapped.");
  m.def("pool_trim", [] { pool().trim(); }, "Free every cached block of the host pool.");
  m.def("pool_set_limit", [](std::size_t bytes) { pool().set_limit(bytes); }, py::arg("bytes"),
        "Most bytes the host pool keeps cached (blocks in use do not count).");
  m.def("pool_stats", [] { return pool().stats(); }, "cached_bytes, limit_bytes, hits, misses.");
}

}  // namespace distvals_py
