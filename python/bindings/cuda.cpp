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
  // Consumers may drop the tensor from any thread. At exit, taking the GIL would end a
  // thread other than the finalizing one; the reference is left to the exiting process.
  if (Py_IsInitialized() && !finalizing()) {
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

collective parse_collective(const std::string& s) {
  if (s == "all_reduce") return collective::all_reduce;
  if (s == "reduce") return collective::reduce;
  if (s == "broadcast") return collective::broadcast;
  if (s == "all_gather") return collective::all_gather;
  if (s == "reduce_scatter") return collective::reduce_scatter;
  throw py::value_error("unknown collective '" + s + "'");
}

// (pointer, elements, CUDA device or -1 for host memory) per replica.
using raw_buffer = std::tuple<std::uintptr_t, std::size_t, int>;
// (cudaStream_t as an integer, its CUDA device or -1) of a stream to follow.
using raw_stream = std::tuple<std::uintptr_t, int>;

buffer_view view(const raw_buffer& raw, distvals::dtype t) {
  const auto& [ptr, count, gpu] = raw;
  buffer_view b;
  b.data = reinterpret_cast<void*>(ptr);
  b.count = count;
  b.type = t;
  if (gpu >= 0) {
    b.dev.kind = distvals::device::kind_t::gpu;
    b.dev.index = gpu;
  }
  return b;
}

std::vector<buffer_view> views(const std::vector<raw_buffer>& raw, distvals::dtype t) {
  std::vector<buffer_view> v;
  v.reserve(raw.size());
  for (const auto& r : raw) v.push_back(view(r, t));
  return v;
}

cuda::stream_view stream_of(const raw_stream& s) {
  return cuda::stream_view(reinterpret_cast<CUstream_st*>(std::get<0>(s)), std::get<1>(s));
}

std::vector<cuda::stream_view> streams(const std::vector<raw_stream>& raw) {
  std::vector<cuda::stream_view> out;
  out.reserve(raw.size());
  for (const auto& s : raw) out.push_back(stream_of(s));
  return out;
}

call_desc make_desc(const std::string& kind, const std::string& dtype, const std::string& op, const std::string& algo,
                    int root, std::size_t count) {
  call_desc d;
  d.kind = parse_collective(kind);
  d.type = distvals::parse_dtype(dtype);
  d.op = distvals::parse_reduce_op(op);
  d.algo = distvals::parse_algorithm(algo);
  d.root = root;
  d.count = count;
  return d;
}

// The single-call style: every replica's buffers from one thread; with `stream` (a
// cudaStream_t as an integer) enqueued there, otherwise waited for on the host.
void run_collective(cuda::group& g, const std::string& kind, const std::string& dtype, const std::string& op,
                    const std::string& algo, int root, const std::vector<raw_buffer>& ins,
                    const std::vector<raw_buffer>& outs, const py::object& stream, int stream_device,
                    const std::vector<raw_stream>& wait_for) {
  const int which = parse_collective(kind) == collective::broadcast ? root : 0;
  if (which < 0 || which >= static_cast<int>(ins.size())) {
    throw py::value_error("root " + std::to_string(root) + " is out of range for " + std::to_string(ins.size()) +
                          " replicas");
  }
  const call_desc d = make_desc(kind, dtype, op, algo, root, std::get<1>(ins[which]));
  const auto iv = views(ins, d.type);
  const auto ov = views(outs, d.type);
  const auto waits = streams(wait_for);
  if (stream.is_none()) {
    run_single(g, [&]() { g.run(d, iv, ov, waits); });
  } else {
    const cuda::stream_view caller(reinterpret_cast<CUstream_st*>(stream.cast<std::uintptr_t>()), stream_device);
    run_single(g, [&]() { g.enqueue(d, iv, ov, caller, waits); });
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
  py::module_ m = parent.def_submodule("cuda", "The CUDA backend: device memory, copies and GPU groups.");
  // Registered as a module of its own, so that `import distvals._core.cuda` (and tools that
  // import modules by name, such as stub checkers) find it.
  py::module_::import("sys").attr("modules")[py::str(m.attr("__name__"))] = m;

  m.def("device_count", &cuda::device_count, "Number of CUDA devices; 0 without a GPU or a driver.");
  m.def("unavailable_reason", &cuda::unavailable_reason, "Why device_count() is 0, or ''.");
  m.def("runtime_version", &cuda::runtime_version, "The CUDA runtime version compiled in (e.g. 13000).");
  m.def("driver_version", &cuda::driver_version, "The driver's CUDA version, 0 without a driver.");
  m.def("device_name", &cuda::device_name, py::arg("gpu"));
  m.def("can_access_peer", &cuda::can_access_peer, py::arg("src"), py::arg("dst"));
  m.def("pointer_device", [](std::uintptr_t p) { return cuda::pointer_device(reinterpret_cast<void*>(p)); },
        py::arg("ptr"), "The CUDA device holding `ptr`, or -1 for host or unknown memory.");

  py::class_<cuda::device_buffer> buffer_class(m, "DeviceBuffer", "Owning device memory (cudaMalloc).");
  refuse_pickling(buffer_class);
  buffer_class
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
        nogil unlocked;
        cuda::copy(reinterpret_cast<void*>(dst), s, n, gpu, to_timeout(timeout));
      },
      py::arg("dst"), py::arg("gpu"), py::arg("src"), py::arg("timeout_seconds") = py::none(),
      "Copies a host array into device memory at `dst` and waits.");
  m.def(
      "copy_to_host",
      [](py::array& dst, std::uintptr_t src, int gpu, const py::object& timeout) {
        void* d = host_pointer(dst, true, "destination");
        const std::size_t n = static_cast<std::size_t>(dst.nbytes());
        nogil unlocked;
        cuda::copy(d, reinterpret_cast<void*>(src), n, gpu, to_timeout(timeout));
      },
      py::arg("dst"), py::arg("src"), py::arg("gpu"), py::arg("timeout_seconds") = py::none(),
      "Copies device memory at `src` into a host array and waits.");
  m.def(
      "copy_device",
      [](std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes, int gpu, const py::object& timeout) {
        nogil unlocked;
        cuda::copy(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src), nbytes, gpu, to_timeout(timeout));
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("gpu"), py::arg("timeout_seconds") = py::none(),
      "Copies device memory to device memory and waits.");
  m.def(
      "fill_bytes",
      [](std::uintptr_t ptr, int value, std::size_t nbytes, int gpu) {
        nogil unlocked;
        cuda::fill_bytes(reinterpret_cast<void*>(ptr), value, nbytes, gpu);
      },
      py::arg("ptr"), py::arg("value"), py::arg("nbytes"), py::arg("gpu"));
  m.def(
      "synchronize_stream",
      [](std::uintptr_t stream, int gpu, const py::object& timeout) {
        nogil unlocked;
        cuda::synchronize(cuda::stream_view(reinterpret_cast<CUstream_st*>(stream), gpu), to_timeout(timeout));
      },
      py::arg("stream"), py::arg("gpu") = -1, py::arg("timeout_seconds") = py::none(),
      "Waits until the work queued so far on a stream (a cudaStream_t as an integer) is done.");

  m.def("to_dlpack", &to_dlpack, py::arg("owner"), py::arg("ptr"), py::arg("shape"), py::arg("dtype"), py::arg("gpu"),
        "A DLPack capsule ('dltensor') for C-contiguous device memory kept alive by `owner`.");
  m.def("from_dlpack", &from_dlpack, py::arg("capsule"),
        "Consumes a DLPack capsule: dict(ptr, shape, strides, dtype=(code, bits, lanes), device=(type, id), keeper).");

  py::class_<cuda::group> group_class(m, "Group", "N replicas on CUDA devices (the engine's group of GPU replicas).");
  refuse_pickling(group_class);
  group_class
      .def(py::init([](const std::vector<std::string>& devices, int logical_per_gpu, const py::object& timeout,
                       std::size_t chunk_bytes, bool peer_access) {
             cuda::group_options o;
             o.timeout = to_timeout(timeout);
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
      .def_property_readonly("timeout_seconds", [](const cuda::group& g) { return timeout_seconds(g.options().timeout); })
      .def("direct_access", &cuda::group::direct_access, py::arg("a"), py::arg("b"))
      .def("replica_stream", [](const cuda::group& g, int r) {
        return reinterpret_cast<std::uintptr_t>(g.replica_stream(r).value());
      }, py::arg("replica"))
      .def("run", &run_collective, py::arg("kind"), py::arg("dtype"), py::arg("op"), py::arg("algorithm"),
           py::arg("root"), py::arg("inputs"), py::arg("outputs"), py::arg("stream") = py::none(),
           py::arg("stream_device") = -1, py::arg("wait_for") = std::vector<raw_stream>{},
           "Runs one collective over (ptr, count, gpu) buffers; with `stream` (a cudaStream_t as an "
           "integer) it is enqueued there without waiting, otherwise it waits until done. It starts after "
           "the work queued on every (stream, device) of `wait_for`, without a host wait.")
      .def(
          "replica_run",
          [](cuda::group& g, int replica, const std::string& kind, const std::string& dtype, const std::string& op,
             const std::string& algo, int root, const raw_buffer& in, const raw_buffer& out,
             const std::vector<std::int64_t>& shape, const py::object& timeout, const py::object& wait_stream,
             int wait_device) {
            const call_desc d = make_desc(kind, dtype, op, algo, root, std::get<1>(in));
            distvals::replica_options o;
            o.timeout = to_timeout(timeout);
            o.shape = shape.data();
            o.ndim = static_cast<int>(shape.size());
            const buffer_view iv = view(in, d.type), ov = view(out, d.type);
            {
              nogil unlocked;
              if (wait_stream.is_none()) {
                g.run(replica, d, iv, ov, o);
              } else {
                g.run(replica, d, iv, ov, o,
                      cuda::stream_view(reinterpret_cast<CUstream_st*>(wait_stream.cast<std::uintptr_t>()), wait_device));
              }
            }
            raise_pending_interrupt();
          },
          py::arg("replica"), py::arg("kind"), py::arg("dtype"), py::arg("op"), py::arg("algorithm"), py::arg("root"),
          py::arg("input"), py::arg("output"), py::arg("shape"), py::arg("timeout_seconds") = py::none(),
          py::arg("wait_stream") = py::none(), py::arg("wait_device") = -1,
          "Replica `replica`'s part of a per-replica collective: it meets the other replicas in the engine, "
          "which checks that they agree; replica 0 then launches the collective for all.")
      .def(
          "report_invalid",
          [](cuda::group& g, int replica, const std::string& why, bool type_error, const py::object& timeout) {
            const auto t = to_timeout(timeout);
            nogil unlocked;
            g.report_invalid(replica, why, type_error, t);
          },
          py::arg("replica"), py::arg("why"), py::arg("type_error"), py::arg("timeout_seconds") = py::none(),
          "Replica `replica`'s arguments were found invalid before it could call replica_run: it meets the "
          "others, and every replica of that call raises `why`.")
      .def("abort", &cuda::group::abort, py::arg("replica"), py::arg("why"))
      .def("cancel", &cuda::group::cancel)
      .def("reset", &cuda::group::reset)
      .def("close", [](cuda::group& g) {
        nogil unlocked;
        g.close();
      })
      .def_property_readonly("aborted", &cuda::group::aborted)
      .def_property_readonly("closed", &cuda::group::closed);

  m.def(
      "time_all_reduce",
      [](cuda::group& g, const std::vector<raw_buffer>& bufs, const std::string& dtype, const std::string& op,
         const std::string& algo, int iterations, int warmup) {
        if (bufs.empty()) throw py::value_error("time_all_reduce needs one buffer per replica");
        const call_desc d = make_desc("all_reduce", dtype, op, algo, 0, std::get<1>(bufs[0]));
        const auto v = views(bufs, d.type);
        std::vector<double> t;
        {
          nogil unlocked;
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
          nogil unlocked;
          t = cuda::time_copy(gpu, bytes, iterations, warmup);
        }
        return as_numpy(t);
      },
      py::arg("gpu"), py::arg("bytes"), py::arg("iterations") = 10, py::arg("warmup") = 2,
      "Seconds of each device-to-device copy of `bytes` bytes (2 * bytes move through memory).");
}

}  // namespace distvals_py
