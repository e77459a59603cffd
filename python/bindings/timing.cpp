// Timing loops run inside the engine, for the benchmark.
#include "bindings.hpp"

namespace distvals_py {
namespace {

// One view per array of `bufs` (kept alive in `keep`), writable.
std::vector<distvals::buffer_view> views_of(const py::sequence& bufs, std::vector<py::array>& keep,
                                            const char* role) {
  std::vector<distvals::buffer_view> v;
  for (int r = 0; r < static_cast<int>(py::len(bufs)); ++r) {
    keep.push_back(as_array(bufs[r], r, true, role));
    v.push_back(view_of(keep.back(), to_dtype(keep.back().dtype(), r)));
  }
  return v;
}

py::array_t<double> as_numpy(const std::vector<double>& t) {
  return py::array_t<double>(static_cast<py::ssize_t>(t.size()), t.data());
}

}  // namespace

void register_timing(py::module_& m) {
  m.def(
      "time_all_reduce",
      [](distvals::group& g, const py::sequence& bufs, const std::string& op, const std::string& algo, int iterations,
         int warmup, const py::object& out) {
        std::vector<py::array> keep;
        const auto v = views_of(bufs, keep, "array");
        if (v.empty()) throw py::value_error("time_all_reduce needs one array per replica");
        std::vector<distvals::buffer_view> o = v;
        if (!out.is_none()) {
          o = views_of(py::reinterpret_borrow<py::sequence>(out), keep, "output");
          if (o.size() != v.size()) throw py::value_error("time_all_reduce: out needs one array per replica");
        }
        const distvals::call_desc d{distvals::collective::all_reduce, v[0].type, distvals::parse_reduce_op(op),
                                    distvals::parse_algorithm(algo), v[0].count, 0};
        std::vector<double> t;
        {
          nogil unlocked;
          t = distvals::time_collective(g, d, v, o, iterations, warmup);
        }
        return as_numpy(t);
      },
      py::arg("group"), py::arg("buffers"), py::arg("op") = "sum", py::arg("algorithm") = "auto",
      py::arg("iterations") = 100, py::arg("warmup") = 5, py::arg("out") = py::none(),
      "Seconds of each of `iterations` all-reduces timed inside the engine: in place, or from "
      "`buffers` into `out` (one array per replica) when given.");
  m.def(
      "time_copy",
      [](int threads, std::size_t bytes, int iterations, int warmup) {
        std::vector<double> t;
        {
          nogil unlocked;
          t = distvals::time_copy(threads, bytes, iterations, warmup);
        }
        return as_numpy(t);
      },
      py::arg("threads"), py::arg("bytes"), py::arg("iterations") = 20, py::arg("warmup") = 2,
      "Seconds of each round in which `threads` threads each copy `bytes` bytes (2*threads*bytes moved).");
  m.def(
      "time_memory_bound",
      [](const py::sequence& bufs, int threads, bool streaming, int iterations, int warmup,
         const py::object& out) {
        std::vector<py::array> keep;
        const auto v = views_of(bufs, keep, "array");
        if (v.empty()) throw py::value_error("time_memory_bound needs at least one array");
        std::vector<distvals::buffer_view> o;
        if (!out.is_none()) o = views_of(py::reinterpret_borrow<py::sequence>(out), keep, "output");
        std::vector<double> t;
        {
          nogil unlocked;
          t = distvals::time_memory_bound(v, threads, streaming, iterations, warmup, o);
        }
        return as_numpy(t);
      },
      py::arg("buffers"), py::arg("threads"), py::arg("streaming") = false, py::arg("iterations") = 20,
      py::arg("warmup") = 2, py::arg("out") = py::none(),
      "Seconds of each round in which `threads` threads read every byte of `buffers` and store it back "
      "in place (N*S read, N*S written; thread p on slice p of every array), timed like time_all_reduce. "
      "`streaming`: non-temporal stores. `out`: one array per buffer, written instead (the bound of an "
      "out-of-place collective). The buffers' contents are unchanged.");
  m.def("streaming_store_min_bytes", &distvals::streaming_store_min_bytes,
        "Smallest total output of one CPU kernel call written with streaming stores (out-of-place only).");
  m.def("set_streaming_store_min_bytes", &distvals::set_streaming_store_min_bytes, py::arg("bytes"),
        "Set that threshold for the whole process (0: always, 2**64-1: never); returns the previous value.");
  m.attr("memory_bound_has_streaming") = distvals::memory_bound_has_streaming();
}

}  // namespace distvals_py
