// Timing loops run inside the engine, for the benchmark.
#include "bindings.hpp"

namespace distvals_py {

void register_timing(py::module_& m) {
  m.def(
      "time_all_reduce",
      [](distvals::group& g, const py::sequence& bufs, const std::string& op, const std::string& algo, int iterations,
         int warmup) {
        std::vector<py::array> keep;
        std::vector<distvals::buffer_view> v;
        for (int r = 0; r < static_cast<int>(py::len(bufs)); ++r) {
          keep.push_back(as_array(bufs[r], r, true, "array"));
          v.push_back(view_of(keep.back(), to_dtype(keep.back().dtype(), r)));
        }
        if (v.empty()) throw py::value_error("time_all_reduce needs one array per replica");
        const distvals::call_desc d{distvals::collective::all_reduce, v[0].type, distvals::parse_reduce_op(op),
                                    distvals::parse_algorithm(algo), v[0].count, 0};
        std::vector<double> t;
        {
          py::gil_scoped_release nogil;
          t = distvals::time_collective(g, d, v, v, iterations, warmup);
        }
        return py::array_t<double>(static_cast<py::ssize_t>(t.size()), t.data());
      },
      py::arg("group"), py::arg("buffers"), py::arg("op") = "sum", py::arg("algorithm") = "auto",
      py::arg("iterations") = 100, py::arg("warmup") = 5,
      "Seconds of each of `iterations` in-place all-reduces, timed inside the engine.");
  m.def(
      "time_copy",
      [](int threads, std::size_t bytes, int iterations, int warmup) {
        std::vector<double> t;
        {
          py::gil_scoped_release nogil;
          t = distvals::time_copy(threads, bytes, iterations, warmup);
        }
        return py::array_t<double>(static_cast<py::ssize_t>(t.size()), t.data());
      },
      py::arg("threads"), py::arg("bytes"), py::arg("iterations") = 20, py::arg("warmup") = 2,
      "Seconds of each round in which `threads` threads each copy `bytes` bytes (2*threads*bytes moved).");
}

}  // namespace distvals_py
