// The CUDA backend. Without a GPU (or a driver) only the checks that need none run:
// the library loads, device_count() is 0, and every entry point fails with a clear
// cuda_error instead of crashing. With a GPU, every collective runs on logical
// replicas (several per GPU) and on all GPUs, parameterized over
// algorithm x replicas x dtype x size x op, against a float64 reference, outputs poisoned.
#include <cstring>
#include <string>
#include <vector>

#include "check.hpp"
#include "distvals/cuda/all.hpp"
#include "distvals/cuda/error.hpp"
#include "reference.hpp"

using namespace distvals;
using namespace distvals_test;

namespace {

bool have_gpu() { return cuda::device_count() > 0; }

bool skip(const char* what) {
  if (have_gpu()) return false;
  std::printf("[skip] %s: no CUDA device (%s)\n", what, cuda::unavailable_reason().c_str());
  return true;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

const dtype kAllTypes[] = {dtype::float16, dtype::bfloat16, dtype::float32, dtype::float64,
                           dtype::int8,    dtype::uint8,    dtype::int32,   dtype::int64};

struct case_t {
  collective kind;
  algorithm algo;
  dtype type;
  std::size_t count;
  reduce_op op;
  bool inplace;
  int root;
  bool async;
};

std::string describe(const case_t& c, int n) {
  return std::string(collective_name(c.kind)) + " algo=" + algorithm_name(c.algo) + " n=" + std::to_string(n) +
         " dtype=" + dtype_name(c.type) + " count=" + std::to_string(c.count) + " op=" + reduce_op_name(c.op) +
         (c.inplace ? " in-place" : "") + (c.async ? " async" : "");
}

void run_case(cuda::group& g, const case_t& c) {
  const int n = g.size();
  const std::size_t oc = c.kind == collective::all_gather ? c.count * n
                         : c.kind == collective::reduce_scatter ? c.count / n
                                                                : c.count;
  const std::size_t es = dtype_size(c.type);
  std::vector<buffer> hin, hout;
  std::vector<cuda::device_buffer> din, dout;
  std::vector<buffer_view> iv, ov;
  for (int r = 0; r < n; ++r) {
    const int gpu = g.gpus()[r];
    hin.emplace_back(c.count, c.type);
    hout.emplace_back(oc, c.type);
    for (std::size_t i = 0; i < c.count; ++i) store(hin[r].data(), c.type, i, value(c.op, c.type, r, i));
    for (std::size_t i = 0; i < oc; ++i) store(hout[r].data(), c.type, i, 99.0);  // poison
    din.emplace_back(std::max<std::size_t>(c.count * es, 1), gpu);
    dout.emplace_back(std::max<std::size_t>(oc * es, 1), gpu);
    cuda::copy(din[r].data(), hin[r].data(), c.count * es, gpu);
    cuda::copy(dout[r].data(), hout[r].data(), oc * es, gpu);
    iv.push_back(cuda::device_view(din[r].data(), c.count, c.type, gpu));
    ov.push_back(c.inplace ? iv.back() : cuda::device_view(dout[r].data(), oc, c.type, gpu));
  }
  const call_desc d{c.kind, c.type, c.op, c.algo, c.count, c.root};
  if (c.async) {
    cuda::stream s(g.gpus()[0]);
    g.enqueue(d, iv, ov, s.view());
    s.synchronize();
  } else {
    g.run(d, iv, ov);
  }
  // Read back every replica's output (and input, which must be untouched out of place).
  std::vector<buffer> got, gin;
  for (int r = 0; r < n; ++r) {
    got.emplace_back(ov[r].count, c.type);
    gin.emplace_back(c.count, c.type);
    cuda::copy(got[r].data(), ov[r].data, ov[r].count * es, g.gpus()[r]);
    cuda::copy(gin[r].data(), iv[r].data, c.count * es, g.gpus()[r]);
  }
  auto ref_reduce = [&](std::size_t i) {
    double acc = value(c.op, c.type, 0, i);
    for (int j = 1; j < n; ++j) acc = combine(c.op, acc, value(c.op, c.type, j, i));
    if (c.op == reduce_op::mean) acc /= n;
    return acc;
  };
  std::size_t wrong = 0;
  std::string first;
  auto expect = [&](int r, std::size_t i, double want) {
    const double v = load(got[r].data(), c.type, i);
    if (!close(v, want, c.type) && wrong++ == 0) {
      first = "replica " + std::to_string(r) + " element " + std::to_string(i) + ": got " + std::to_string(v) +
              ", want " + std::to_string(want);
    }
  };
  for (int r = 0; r < n; ++r) {
    switch (c.kind) {
      case collective::all_reduce:
        for (std::size_t i = 0; i < c.count; ++i) expect(r, i, ref_reduce(i));
        break;
      case collective::reduce:
        if (r == c.root) {
          for (std::size_t i = 0; i < c.count; ++i) expect(r, i, ref_reduce(i));
        } else if (!c.inplace) {
          for (std::size_t i = 0; i < oc; ++i) expect(r, i, 99.0);
        }
        break;
      case collective::broadcast:
        for (std::size_t i = 0; i < c.count; ++i) expect(r, i, value(c.op, c.type, c.root, i));
        break;
      case collective::all_gather:
        for (int j = 0; j < n; ++j) {
          for (std::size_t i = 0; i < c.count; ++i) expect(r, j * c.count + i, value(c.op, c.type, j, i));
        }
        break;
      case collective::reduce_scatter:
        for (std::size_t i = 0; i < oc; ++i) expect(r, i, ref_reduce(r * oc + i));
        break;
    }
    if (!c.inplace) {
      for (std::size_t i = 0; i < c.count; ++i) {
        if (load(gin[r].data(), c.type, i) != value(c.op, c.type, r, i) && wrong++ == 0) {
          first = "input of replica " + std::to_string(r) + " modified";
        }
      }
    }
  }
  CHECK_MSG(wrong == 0, describe(c, n) + ": " + std::to_string(wrong) + " wrong, first " + first);
}

// Groups to test on: logical replicas of GPU 0, and one replica per GPU when there are several.
std::vector<std::vector<int>> layouts() {
  std::vector<std::vector<int>> out;
  for (int n : {1, 2, 3, 4, 8}) out.push_back(std::vector<int>(static_cast<std::size_t>(n), 0));
  const int count = cuda::device_count();
  if (count > 1) {
    std::vector<int> all;
    for (int d = 0; d < count; ++d) all.push_back(d);
    out.push_back(all);
  }
  return out;
}

}  // namespace

TEST_CASE("device_count() is 0 without a GPU, and the reason is given") {
  const int n = cuda::device_count();
  CHECK(n >= 0);
  if (n == 0) {
    CHECK(!cuda::unavailable_reason().empty());
    CHECK(cuda::driver_version() >= 0);
  } else {
    CHECK(cuda::unavailable_reason().empty());
    CHECK(!cuda::device_name(0).empty());
  }
  CHECK(cuda::runtime_version() > 0);
}

TEST_CASE("without a GPU every entry point throws cuda_error naming what is missing") {
  if (have_gpu()) return;
  try {
    cuda::group g(std::vector<int>{0, 0});
    CHECK_MSG(false, "a GPU group was created without a GPU");
  } catch (const cuda_error& e) {
    CHECK_MSG(contains(e.what(), "no CUDA device"), e.what());
  }
  CHECK_THROWS_AS(cuda::device_buffer(64, 0), cuda_error);
  CHECK_THROWS_AS(cuda::stream(0), cuda_error);
  int x = 0, y = 1;
  CHECK_THROWS_AS(cuda::copy(&x, &y, sizeof(x), 0), cuda_error);
  CHECK(cuda::pointer_device(&x) == -1);
  CHECK(!cuda::can_access_peer(0, 1));
}

TEST_CASE("DISTVALS_CUDA_TRY names the call, the file, the line and the CUDA error") {
  std::string msg;
  int line = 0;
  try {
    line = __LINE__ + 1;
    DISTVALS_CUDA_TRY(cudaSetDevice(-1));
  } catch (const cuda_error& e) {
    msg = e.what();
  }
  CHECK_MSG(contains(msg, "cudaSetDevice(-1)"), msg);
  CHECK_MSG(contains(msg, "test_cuda.cpp:" + std::to_string(line)), msg);
  CHECK_MSG(contains(msg, "cudaError"), msg);
  // The runtime's last error was cleared, so the next check does not see it again
  // (without a driver, initialization keeps failing, so only with a GPU).
  if (have_gpu()) CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("GPU group: bad arguments are rejected before any work") {
  if (skip("GPU argument checks")) return;
  cuda::group g(std::vector<int>{0, 0});
  cuda::device_buffer a(64, 0), b(64, 0);
  buffer h(16, dtype::float32);
  auto va = cuda::device_view(a.data(), 16, dtype::float32, 0);
  auto vb = cuda::device_view(b.data(), 16, dtype::float32, 0);
  CHECK_THROWS_AS(g.all_reduce({va, h.view()}, {va, h.view()}, reduce_op::sum), invalid_argument_error);
  CHECK_THROWS_AS(g.all_reduce({va, va}, {va, va}, reduce_op::sum), invalid_argument_error);  // same buffer twice
  CHECK_THROWS_AS(g.all_reduce({va, cuda::device_view(b.data(), 15, dtype::float32, 0)}, {va, vb}, reduce_op::sum),
                  invalid_argument_error);
  CHECK_THROWS_AS(g.all_reduce({cuda::device_view(a.data(), 16, dtype::int32, 0), cuda::device_view(b.data(), 16, dtype::int32, 0)},
                               {cuda::device_view(a.data(), 16, dtype::int32, 0), cuda::device_view(b.data(), 16, dtype::int32, 0)},
                               reduce_op::mean),
                  dtype_error);
  CHECK_THROWS_AS(cuda::group(std::vector<int>{cuda::device_count()}), invalid_argument_error);
}

TEST_CASE("GPU all_reduce: algorithm x replicas x dtype x size x op") {
  if (skip("GPU all_reduce")) return;
  for (const auto& gpus : layouts()) {
    cuda::group_options o;
    o.chunk_bytes = 4096;  // small chunks so that rings and trees pipeline
    cuda::group g(gpus, o);
    for (algorithm a : {algorithm::ring, algorithm::tree, algorithm::direct, algorithm::automatic}) {
      for (dtype t : kAllTypes) {
        for (std::size_t count : {0ul, 1ul, 1009ul, 70001ul}) {
          for (reduce_op op : {reduce_op::sum, reduce_op::prod, reduce_op::min, reduce_op::max, reduce_op::mean}) {
            if (op == reduce_op::mean && !is_floating(t)) continue;
            if (count == 70001 && op != reduce_op::sum && op != reduce_op::mean) continue;
            for (bool inplace : {false, true}) {
              run_case(g, {collective::all_reduce, a, t, count, op, inplace, 0, false});
            }
          }
        }
      }
    }
    run_case(g, {collective::all_reduce, algorithm::ring, dtype::float32, (3u << 20) / 4 + 5, reduce_op::sum, true, 0, true});
    run_case(g, {collective::all_reduce, algorithm::direct, dtype::bfloat16, (1u << 20) + 3, reduce_op::mean, false, 0, true});
  }
}

TEST_CASE("GPU reduce, broadcast, all_gather, reduce_scatter") {
  if (skip("GPU reduce/broadcast/all_gather/reduce_scatter")) return;
  for (const auto& gpus : layouts()) {
    cuda::group g(gpus);
    const int n = g.size();
    for (dtype t : kAllTypes) {
      for (std::size_t count : {0ul, 1ul, 1009ul}) {
        for (bool async : {false, true}) {
          const int root = n - 1;
          run_case(g, {collective::reduce, algorithm::direct, t, count, reduce_op::sum, false, root, async});
          run_case(g, {collective::reduce, algorithm::direct, t, count, reduce_op::max, true, 0, async});
          run_case(g, {collective::broadcast, algorithm::direct, t, count, reduce_op::sum, false, root, async});
          run_case(g, {collective::broadcast, algorithm::direct, t, count, reduce_op::sum, true, 0, async});
          run_case(g, {collective::all_gather, algorithm::direct, t, count, reduce_op::sum, false, 0, async});
          run_case(g, {collective::reduce_scatter, algorithm::direct, t, count * n, reduce_op::sum, false, 0, async});
          if (is_floating(t)) {
            run_case(g, {collective::reduce_scatter, algorithm::direct, t, count * n, reduce_op::mean, false, 0, async});
          }
        }
      }
    }
  }
}

TEST_CASE("GPU without peer access: staged copies give the same results") {
  if (skip("GPU staged copies")) return;
  if (cuda::device_count() < 2) {
    std::printf("[skip] staged copies: needs 2 GPUs\n");
    return;
  }
  cuda::group_options o;
  o.peer_access = false;
  o.chunk_bytes = 4096;
  std::vector<int> gpus{0, 1, 0, 1};
  cuda::group g(gpus, o);
  for (algorithm a : {algorithm::ring, algorithm::tree, algorithm::direct}) {
    run_case(g, {collective::all_reduce, a, dtype::float32, 70001, reduce_op::sum, true, 0, false});
    run_case(g, {collective::all_reduce, a, dtype::float16, 1009, reduce_op::mean, false, 0, true});
  }
  run_case(g, {collective::all_gather, algorithm::direct, dtype::int32, 1009, reduce_op::sum, false, 0, false});
  run_case(g, {collective::reduce_scatter, algorithm::direct, dtype::float64, 4036, reduce_op::max, false, 0, false});
}

TEST_CASE("GPU integer sums wrap around like numpy") {
  if (skip("GPU integer wrap")) return;
  cuda::group g(std::vector<int>{0, 0});
  cuda::device_buffer a(1, 0), b(1, 0);
  const std::int8_t v = 100;
  cuda::copy(a.data(), &v, 1, 0);
  cuda::copy(b.data(), &v, 1, 0);
  auto va = cuda::device_view(a.data(), 1, dtype::int8, 0), vb = cuda::device_view(b.data(), 1, dtype::int8, 0);
  g.all_reduce({va, vb}, {va, vb}, reduce_op::sum);
  std::int8_t ra = 0, rb = 0;
  cuda::copy(&ra, a.data(), 1, 0);
  cuda::copy(&rb, b.data(), 1, 0);
  CHECK(ra == static_cast<std::int8_t>(-56));
  CHECK(rb == static_cast<std::int8_t>(-56));
}

TEST_MAIN()
