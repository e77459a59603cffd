// distvals._core.cuda: the CUDA backend's Python face, built only with DISTVALS_HAS_CUDA.
//
// Device memory crosses this boundary as plain integers (pointer, element count, CUDA
// device), which the Python layer (distvals.cuda) takes from its DeviceArray, from
// __cuda_array_interface__ or from DLPack. Every blocking call releases the GIL. No
// CUDA runtime call is made here directly: everything goes through libdistvals, so
// this module carries no copy of the CUDA runtime of its own.
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.hpp"
#include "distvals/cuda/all.hpp"

namespace distvals_py {
namespace {

namespace cuda = distvals::cuda;
using distvals::buffer_view;
using distvals::call_desc;
using distvals::collective;

// ---- DLPack (the ABI of dlpack.h, unversioned capsules named "dltensor") --------------

struct DLDevice {
  std::int32_t device_type;
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
constexpr std::int32_t kDLCUDA = 2;
enum : std::uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4 };

DLDataType dl_dtype(const std::string& name) {
  const distvals::dtype t = distvals::parse_dtype(name);
  const std::uint8_t bits = static_cast<std::uint8_t>(distvals::dtype_size(t) * 8);
  switch (t) {
    case distvals::dtype::bfloat16: return {kDLBfloat, bits, 1};
    case distvals::dtype::float16:
    case distvals::dtype::float32:
    case distvals::dtype::float64: return {kDLFloat, bits, 1};
    case distvals::dtype::uint8: return {kDLUInt, bits, 1};
    default: return {kDLInt, bits, 1};
  }
}

// The exported tensor owns its shape and strides and a reference to the Python object
// that keeps the memory alive.
struct export_ctx {
  std::vector<std::int64_t> shape, strides;
  PyObject* owner = nullptr;
  DLManagedTensor tensor{};
};

void export_deleter(DLManagedTensor* t) {
  auto* ctx = static_cast<export_ctx*>(t->manager_ctx);
  // Consumers may drop the tensor from any thread.
  if (Py_IsInitialized()) {
    PyGILState_STATE st = PyGILState_Ensure();
    Py_XDECREF(ctx->owner);
    PyGILState_Release(st);
  }
  delete ctx;
}

void export_capsule_destructor(PyObject* cap) {
  // A capsule that no consumer renamed to "used_dltensor" still owns its tensor.
  if (PyCapsule_IsValid(cap, "dltensor")) {
    auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
    if (t && t->deleter) t->deleter(t);
  }
}

py::object to_dlpack(const py::object& owner, std::uintptr_t ptr, const std::vector<std::int64_t>& shape,
                     const std::string& dtype, int gpu) {
  auto* ctx = new export_ctx;
  ctx->shape = shape;
  ctx->strides.assign(shape.size(), 1);
  for (std::size_t i = shape.size(); i-- > 1;) ctx->strides[i - 1] = ctx->strides[i] * shape[i];
  DLTensor& t = ctx->tensor.dl_tensor;
  try {
    t.dtype = dl_dtype(dtype);
  } catch (...) {
    delete ctx;
    throw;
  }
  t.data = reinterpret_cast<void*>(ptr);
  t.device = {kDLCUDA, gpu};
  t.ndim = static_cast<std::int32_t>(shape.size());
  t.shape = ctx->shape.data();
  t.strides = ctx->strides.data();
  t.byte_offset = 0;
  ctx->tensor.manager_ctx = ctx;
  ctx->tensor.deleter = &export_deleter;
  ctx->owner = owner.ptr();
  Py_INCREF(ctx->owner);
  PyObject* cap = PyCapsule_New(&ctx->tensor, "dltensor", &export_capsule_destructor);
  if (!cap) {
    export_deleter(&ctx->tensor);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(cap);
}

void keeper_destructor(PyObject* cap) {
  auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "distvals.dlpack_keeper"));
  if (t && t->deleter) t->deleter(t);
}

// Consumes a "dltensor" capsule: returns a dict describing the memory, with "keeper",
// an object that releases the producer's tensor when it goes away.
py::dict from_dlpack(const py::object& capsule) {
  if (!PyCapsule_IsValid(capsule.ptr(), "dltensor")) {
    throw py::type_error("expected an unconsumed DLPack capsule named 'dltensor'");
  }
  auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  PyObject* keeper = PyCapsule_New(t, "distvals.dlpack_keeper", &keeper_destructor);
  if (!keeper) throw py::error_already_set();
  py::object keep = py::reinterpret_steal<py::object>(keeper);
  if (PyCapsule_SetName(capsule.ptr(), "used_dltensor") != 0) throw py::error_already_set();
  const DLTensor& d = t->dl_tensor;
  py::list shape, strides;
  for (int i = 0; i < d.ndim; ++i) shape.append(d.shape[i]);
  py::object st = py::none();
  if (d.strides) {
    for (int i = 0; i < d.ndim; ++i) strides.append(d.strides[i]);
    st = strides;
  }
  py::dict out;
  out["ptr"] = reinterpret_cast<std::uintptr_t>(d.data) + d.byte_offset;
  out["shape"] = py::tuple(shape);
  out["strides"] = st;
  out["dtype"] = py::make_tuple(d.dtype.code, d.dtype.bits, d.dtype.lanes);
  out["device"] = py::make_tuple(d.device.device_type, d.device.device_id);
  out["keeper"] = keep;
  return out;
}

// ---- collectives --------------------------------------------------------------------------

unsigned long main_thread = 0;

bool interrupted() {
  if (PyThread_get_thread_ident() != main_thread || !Py_IsInitialized()) return false;
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) {
    PyErr_Clear();  // raised again as KeyboardInterrupt by the exception translator
    return true;
  }
  return false;
}

collective parse_collective(const std::string& s) {
  if (s == "all_reduce") return collective::all_reduce;
  if (s == "reduce") return collective::reduce;
  if (s == "broadcast") return collective::broadcast;
  if (s == "all_gather") return collective::all_gather;
  if (s == "reduce_scatter") return collective::reduce_scatter;
  throw py::value_error("unknown collective '" + s + "'");
}

std::chrono::milliseconds to_ms(const py::object& seconds) {
  const auto t = to_timeout(seconds);
  if (t.count() == 0) return std::chrono::milliseconds{0};
  // The GPU group keeps whole milliseconds and adds them to the clock: at least 1 ms,
  // and "no timeout" as a century.
  const auto century = std::chrono::hours(24 * 365 * 100);
  if (t >= century) return std::chrono::duration_cast<std::chrono::milliseconds>(century);
  return std::max(std::chrono::milliseconds{1}, std::chrono::ceil<std::chrono::milliseconds>(t));
}

// (pointer, elements, CUDA device or -1 for host memory) per replica.
using raw_buffer = std::tuple<std::uintptr_t, std::size_t, int>;

std::vector<buffer_view> views(const std::vector<raw_buffer>& raw, distvals::dtype t) {
  std::vector<buffer_view> v;
  v.reserve(raw.size());
  for (const auto& [ptr, count, gpu] : raw) {
    buffer_view b;
    b.data = reinterpret_cast<void*>(ptr);
    b.count = count;
    b.type = t;
    if (gpu >= 0) {
      b.dev.kind = distvals::device::kind_t::gpu;
      b.dev.index = gpu;
    }
    v.push_back(b);
  }
  return v;
}

call_desc make_desc(const std::string& kind, const std::string& dtype, const std::string& op, const std::string& algo,
                    int root, const std::vector<raw_buffer>& ins) {
  call_desc d;
  d.kind = parse_collective(kind);
  d.type = distvals::parse_dtype(dtype);
  d.op = distvals::parse_reduce_op(op);
  d.algo = distvals::parse_algorithm(algo);
  d.root = root;
  const int which = d.kind == collective::broadcast ? root : 0;
  if (which < 0 || which >= static_cast<int>(ins.size())) {
    throw py::value_error("root " + std::to_string(root) + " is out of range for " + std::to_string(ins.size()) +
                          " replicas");
  }
  d.count = std::get<1>(ins[which]);
  return d;
}

void run_collective(cuda::group& g, const std::string& kind, const std::string& dtype, const std::string& op,
                    const std::string& algo, int root, const std::vector<raw_buffer>& ins,
                    const std::vector<raw_buffer>& outs, const py::object& stream, int stream_device) {
  const call_desc d = make_desc(kind, dtype, op, algo, root, ins);
  const auto iv = views(ins, d.type);
  const auto ov = views(outs, d.type);
  const bool async = !stream.is_none();
  const auto handle = async ? reinterpret_cast<CUstream_st*>(stream.cast<std::uintptr_t>()) : nullptr;
  py::gil_scoped_release nogil;
  try {
    if (async) {
      g.enqueue(d, iv, ov, cuda::stream_view(handle, stream_device));
    } else {
      g.run(d, iv, ov);
    }
  } catch (const distvals::timeout_error&) {
    // Nobody else is inside (calls are serialized), so the group can be reset at once.
    if (!g.closed()) g.reset();
    throw;
  } catch (const distvals::aborted_error&) {
    if (!g.closed()) g.reset();
    throw;
  }
}

py::array_t<double> as_numpy(const std::vector<double>& t) {
  return py::array_t<double>(static_cast<py::ssize_t>(t.size()), t.data());
}

void* host_pointer(const py::array& a, bool writable, const char* what) {
  const int flags = py::detail::array_proxy(a.ptr())->flags;
  if (!(flags & py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_)) {
    throw py::value_error(std::string(what) + " must be a C-contiguous host array");
  }
  if (writable && !(flags & py::detail::npy_api::NPY_ARRAY_WRITEABLE_)) {
    throw py::value_error(std::string(what) + " is read-only");
  }
  return const_cast<void*>(a.data());
}

}  // namespace

void register_cuda(py::module_& parent) {
  main_thread = PyThread_get_thread_ident();
  py::module_ m = parent.def_submodule("cuda", "The CUDA backend: device memory, copies and GPU groups.");

  m.def("device_count", &cuda::device_count, "Number of CUDA devices; 0 without a GPU or a driver.");
  m.def("unavailable_reason", &cuda::unavailable_reason, "Why device_count() is 0, or ''.");
  m.def("runtime_version", &cuda::runtime_version, "The CUDA runtime version compiled in (e.g. 13000).");
  m.def("driver_version", &cuda::driver_version, "The driver's CUDA version, 0 without a driver.");
  m.def("device_name", &cuda::device_name, py::arg("gpu"));
  m.def("can_access_peer", &cuda::can_access_peer, py::arg("src"), py::arg("dst"));
  m.def("pointer_device", [](std::uintptr_t p) { return cuda::pointer_device(reinterpret_cast<void*>(p)); },
        py::arg("ptr"), "The CUDA device holding `ptr`, or -1 for host or unknown memory.");

  py::class_<cuda::device_buffer>(m, "DeviceBuffer", "Owning device memory (cudaMalloc).")
      .def(py::init<std::size_t, int>(), py::arg("nbytes"), py::arg("gpu"))
      .def_property_readonly("ptr", [](const cuda::device_buffer& b) { return reinterpret_cast<std::uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &cuda::device_buffer::size)
      .def_property_readonly("gpu", &cuda::device_buffer::device)
      .def("__repr__", [](const cuda::device_buffer& b) {
        return "DeviceBuffer(nbytes=" + std::to_string(b.size()) + ", gpu=" + std::to_string(b.device()) + ")";
      });

  m.def(
      "copy_to_device",
      [](std::uintptr_t dst, int gpu, const py::array& src, const py::object& timeout) {
        void* s = host_pointer(src, false, "source");
        const std::size_t n = static_cast<std::size_t>(src.nbytes());
        py::gil_scoped_release nogil;
        cuda::copy(reinterpret_cast<void*>(dst), s, n, gpu, to_ms(timeout));
      },
      py::arg("dst"), py::arg("gpu"), py::arg("src"), py::arg("timeout_seconds") = py::none(),
      "Copies a host array into device memory at `dst` and waits.");
  m.def(
      "copy_to_host",
      [](py::array& dst, std::uintptr_t src, int gpu, const py::object& timeout) {
        void* d = host_pointer(dst, true, "destination");
        const std::size_t n = static_cast<std::size_t>(dst.nbytes());
        py::gil_scoped_release nogil;
        cuda::copy(d, reinterpret_cast<void*>(src), n, gpu, to_ms(timeout));
      },
      py::arg("dst"), py::arg("src"), py::arg("gpu"), py::arg("timeout_seconds") = py::none(),
      "Copies device memory at `src` into a host array and waits.");
  m.def(
      "copy_device",
      [](std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes, int gpu, const py::object& timeout) {
        py::gil_scoped_release nogil;
        cuda::copy(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src), nbytes, gpu, to_ms(timeout));
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("gpu"), py::arg("timeout_seconds") = py::none(),
      "Copies device memory to device memory and waits.");
  m.def(
      "fill_bytes",
      [](std::uintptr_t ptr, int value, std::size_t nbytes, int gpu) {
        py::gil_scoped_release nogil;
        cuda::fill_bytes(reinterpret_cast<void*>(ptr), value, nbytes, gpu);
      },
      py::arg("ptr"), py::arg("value"), py::arg("nbytes"), py::arg("gpu"));
  m.def(
      "synchronize_stream",
      [](std::uintptr_t stream, int gpu, const py::object& timeout) {
        py::gil_scoped_release nogil;
        cuda::synchronize(cuda::stream_view(reinterpret_cast<CUstream_st*>(stream), gpu), to_ms(timeout));
      },
      py::arg("stream"), py::arg("gpu") = -1, py::arg("timeout_seconds") = py::none(),
      "Waits until the work queued so far on a stream (a cudaStream_t as an integer) is done.");

  m.def("to_dlpack", &to_dlpack, py::arg("owner"), py::arg("ptr"), py::arg("shape"), py::arg("dtype"), py::arg("gpu"),
        "A DLPack capsule ('dltensor') for C-contiguous device memory kept alive by `owner`.");
  m.def("from_dlpack", &from_dlpack, py::arg("capsule"),
        "Consumes a DLPack capsule: dict(ptr, shape, strides, dtype=(code, bits, lanes), device=(type, id), keeper).");

  py::class_<cuda::group>(m, "Group", "N replicas on CUDA devices (the engine's GPU group).")
      .def(py::init([](const std::vector<std::string>& devices, int logical_per_gpu, const py::object& timeout,
                       std::size_t chunk_bytes, bool peer_access) {
             cuda::group_options o;
             o.timeout = to_ms(timeout);
             o.chunk_bytes = chunk_bytes;
             o.peer_access = peer_access;
             o.interrupted = &interrupted;
             std::vector<distvals::device> ds;
             for (const auto& d : devices) ds.push_back(distvals::device::parse(d));
             return new cuda::group(ds, logical_per_gpu, o);
           }),
           py::arg("devices"), py::arg("logical_per_gpu") = 1, py::arg("timeout_seconds") = py::none(),
           py::arg("chunk_bytes") = 0, py::arg("peer_access") = true)
      .def_property_readonly("size", &cuda::group::size)
      .def_property_readonly("devices", [](const cuda::group& g) {
        py::list out;
        for (const auto& d : g.devices()) out.append(d.str());
        return out;
      })
      .def_property_readonly("gpus", [](const cuda::group& g) { return g.gpus(); })
      .def_property_readonly("timeout_seconds", [](const cuda::group& g) { return g.options().timeout.count() / 1000.0; })
      .def("direct_access", &cuda::group::direct_access, py::arg("a"), py::arg("b"))
      .def("replica_stream", [](const cuda::group& g, int r) {
        return reinterpret_cast<std::uintptr_t>(g.replica_stream(r).value());
      }, py::arg("replica"))
      .def("run", &run_collective, py::arg("kind"), py::arg("dtype"), py::arg("op"), py::arg("algorithm"),
           py::arg("root"), py::arg("inputs"), py::arg("outputs"), py::arg("stream") = py::none(),
           py::arg("stream_device") = -1,
           "Runs one collective over (ptr, count, gpu) buffers; with `stream` (a cudaStream_t as an "
           "integer) it is enqueued there without waiting, otherwise it waits until done.")
      .def("abort", &cuda::group::abort, py::arg("replica"), py::arg("why"))
      .def("cancel", &cuda::group::cancel)
      .def("reset", &cuda::group::reset)
      .def("close", [](cuda::group& g) {
        py::gil_scoped_release nogil;
        g.close();
      })
      .def_property_readonly("aborted", &cuda::group::aborted)
      .def_property_readonly("closed", &cuda::group::closed);

  m.def(
      "time_all_reduce",
      [](cuda::group& g, const std::vector<raw_buffer>& bufs, const std::string& dtype, const std::string& op,
         const std::string& algo, int iterations, int warmup) {
        const call_desc d = make_desc("all_reduce", dtype, op, algo, 0, bufs);
        const auto v = views(bufs, d.type);
        std::vector<double> t;
        {
          py::gil_scoped_release nogil;
          t = cuda::time_collective(g, d, v, v, iterations, warmup);
        }
        return as_numpy(t);
      },
      py::arg("group"), py::arg("buffers"), py::arg("dtype"), py::arg("op") = "sum", py::arg("algorithm") = "auto",
      py::arg("iterations") = 20, py::arg("warmup") = 3,
      "Seconds of each in-place all-reduce, timed with CUDA events around back-to-back calls.");
  m.def(
      "time_copy",
      [](int gpu, std::size_t bytes, int iterations, int warmup) {
        std::vector<double> t;
        {
          py::gil_scoped_release nogil;
          t = cuda::time_copy(gpu, bytes, iterations, warmup);
        }
        return as_numpy(t);
      },
      py::arg("gpu"), py::arg("bytes"), py::arg("iterations") = 10, py::arg("warmup") = 2,
      "Seconds of each device-to-device copy of `bytes` bytes (2 * bytes move through memory).");
}

}  // namespace distvals_py
