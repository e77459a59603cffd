// distvals from C++: four CPU replicas all-reduce their buffers, first from four
// threads (one per replica, each passing its own buffer), then from one thread that
// passes all four. Every replica's result is checked against a float64 reference,
// and a short bandwidth table follows.
//
// Usage: distvals_example [max_bytes]   (default 4 MiB per replica)
// Exit status: 0 when every result is right, 1 when any element is wrong, 2 on an error.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include <distvals/distvals.hpp>

namespace dv = distvals;

namespace {

constexpr int kReplicas = 4;

/// Distinct small integers per replica and element: exact in every dtype the example
/// uses, so a correct result matches the reference exactly and any misplaced chunk
/// shows up as a wrong element.
double value_of(int replica, std::size_t i) {
  return 3.0 * (replica + 1) + static_cast<double>(i % 251) - 125.0;
}

template <class T>
void fill(dv::buffer& b, int replica) {
  T* p = b.as<T>();
  for (std::size_t i = 0; i < b.count(); ++i) p[i] = static_cast<T>(value_of(replica, i));
}

/// The float64 reference of `op` over all replicas for element i.
double reference(dv::reduce_op op, std::size_t i) {
  double acc = value_of(0, i);
  for (int r = 1; r < kReplicas; ++r) {
    const double v = value_of(r, i);
    switch (op) {
      case dv::reduce_op::sum:
      case dv::reduce_op::mean: acc += v; break;
      case dv::reduce_op::prod: acc *= v; break;
      case dv::reduce_op::min: acc = std::min(acc, v); break;
      case dv::reduce_op::max: acc = std::max(acc, v); break;
    }
  }
  return op == dv::reduce_op::mean ? acc / kReplicas : acc;
}

/// Number of wrong elements over every replica's output.
template <class T>
std::size_t count_wrong(const std::vector<dv::buffer>& outs, dv::reduce_op op) {
  std::size_t wrong = 0;
  for (const dv::buffer& b : outs) {
    const T* p = b.as<T>();
    for (std::size_t i = 0; i < b.count(); ++i) {
      const double want = reference(op, i);
      const double tol = 1e-6 * std::max(1.0, std::fabs(want));
      if (!(std::fabs(static_cast<double>(p[i]) - want) <= tol)) ++wrong;
    }
  }
  return wrong;
}

std::size_t count_wrong(const std::vector<dv::buffer>& outs, dv::dtype t, dv::reduce_op op) {
  switch (t) {
    case dv::dtype::float32: return count_wrong<float>(outs, op);
    case dv::dtype::float64: return count_wrong<double>(outs, op);
    case dv::dtype::int32: return count_wrong<std::int32_t>(outs, op);
    default: throw std::logic_error("the example checks float32, float64 and int32 only");
  }
}

struct replica_buffers {
  std::vector<dv::buffer> in, out;
  std::vector<dv::buffer_view> in_views, out_views;

  replica_buffers(std::size_t count, dv::dtype t) {
    for (int r = 0; r < kReplicas; ++r) {
      in.emplace_back(count, t);
      out.emplace_back(count, t);
      switch (t) {
        case dv::dtype::float32: fill<float>(in.back(), r); break;
        case dv::dtype::float64: fill<double>(in.back(), r); break;
        case dv::dtype::int32: fill<std::int32_t>(in.back(), r); break;
        default: throw std::logic_error("unsupported dtype in the example");
      }
      in_views.push_back(in.back().view());
      out_views.push_back(out.back().view());
    }
  }
};

/// Per-replica style: one thread per replica, each calling group::run with its own
/// buffers once untimed and then `iterations` times. An exception in one thread aborts the group, which
/// releases the others; the first error is rethrown here. Returns seconds per call.
double run_from_threads(dv::group& g, const dv::call_desc& desc, const replica_buffers& b,
                        int iterations) {
  std::vector<std::exception_ptr> errors(kReplicas);
  std::vector<double> seconds(kReplicas, 0.0);
  std::vector<std::thread> threads;
  for (int r = 0; r < kReplicas; ++r) {
    threads.emplace_back([&, r] {
      try {
        g.run(r, desc, b.in_views[r], b.out_views[r]);  // all threads started and met
        const auto t0 = std::chrono::steady_clock::now();
        for (int it = 0; it < iterations; ++it) g.run(r, desc, b.in_views[r], b.out_views[r]);
        seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      } catch (...) {
        errors[r] = std::current_exception();
        g.abort(r, "the example's thread for this replica failed");
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return *std::max_element(seconds.begin(), seconds.end()) / iterations;
}

/// Single-call style: this thread passes all four buffers. Returns the median seconds.
double run_from_one_thread(dv::group& g, const dv::call_desc& desc, const replica_buffers& b,
                           int iterations) {
  std::vector<double> t;
  for (int it = 0; it < iterations; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    g.all_reduce(b.in_views, b.out_views, desc.op, desc.algo);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// Checks every combination once in both styles; returns the number of failed checks.
int check_results(dv::group& g) {
  int failures = 0;
  const std::size_t counts[] = {0, 1, 1021, 100003};  // empty, one, primes
  const dv::algorithm algos[] = {dv::algorithm::ring, dv::algorithm::tree, dv::algorithm::direct,
                                 dv::algorithm::automatic};
  struct typed_op {
    dv::dtype type;
    dv::reduce_op op;
  };
  const typed_op cases[] = {{dv::dtype::float32, dv::reduce_op::sum},
                            {dv::dtype::float64, dv::reduce_op::mean},
                            {dv::dtype::float32, dv::reduce_op::max},
                            {dv::dtype::int32, dv::reduce_op::sum},
                            {dv::dtype::int32, dv::reduce_op::min}};
  for (const typed_op& c : cases) {
    for (std::size_t count : counts) {
      for (dv::algorithm a : algos) {
        const dv::call_desc desc{dv::collective::all_reduce, c.type, c.op, a, count, 0};
        for (int style = 0; style < 2; ++style) {
          replica_buffers b(count, c.type);
          if (style == 0) {
            run_from_threads(g, desc, b, 1);
          } else {
            run_from_one_thread(g, desc, b, 1);
          }
          const std::size_t wrong = count_wrong(b.out, c.type, c.op);
          if (wrong != 0) {
            ++failures;
            std::printf("WRONG: %s %s %s count=%zu %s: %zu wrong elements\n",
                        style == 0 ? "threads" : "one-thread", dv::dtype_name(c.type),
                        dv::reduce_op_name(c.op), count, dv::algorithm_name(a), wrong);
          }
        }
      }
    }
  }
  return failures;
}

/// Prints time and bandwidth per size, algorithm and style for float32 sum; the
/// results of the timed calls are checked too. Returns the number of failed checks.
int bandwidth_table(dv::group& g, std::size_t max_bytes) {
  int failures = 0;
  std::printf("\n%d replicas, float32 sum, out of place\n", kReplicas);
  std::printf("%10s %7s %11s %10s %12s %12s\n", "bytes", "algo", "style", "time(us)", "algbw(GB/s)",
              "busbw(GB/s)");
  for (std::size_t bytes = 4096; bytes <= max_bytes; bytes *= 16) {
    const std::size_t count = bytes / sizeof(float);
    const int iterations = bytes <= (64u << 10) ? 200 : bytes <= (1u << 20) ? 40 : 10;
    for (dv::algorithm a : {dv::algorithm::ring, dv::algorithm::tree, dv::algorithm::direct,
                            dv::algorithm::automatic}) {
      const dv::call_desc desc{dv::collective::all_reduce, dv::dtype::float32, dv::reduce_op::sum,
                               a, count, 0};
      for (int style = 0; style < 2; ++style) {
        replica_buffers b(count, dv::dtype::float32);
        const double t = style == 0 ? run_from_threads(g, desc, b, iterations)
                                    : run_from_one_thread(g, desc, b, iterations);
        if (count_wrong(b.out, dv::dtype::float32, dv::reduce_op::sum) != 0) ++failures;
        const double algbw = static_cast<double>(bytes) / t / 1e9;
        const double busbw = algbw * 2.0 * (kReplicas - 1) / kReplicas;
        std::printf("%10zu %7s %11s %10.1f %12.3f %12.3f\n", bytes, dv::algorithm_name(a),
                    style == 0 ? "threads" : "one-thread", t * 1e6, algbw, busbw);
      }
    }
  }
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t max_bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (4u << 20);
  try {
    dv::group_options options;
    options.timeout = std::chrono::seconds(60);  // a stuck replica fails instead of hanging
    dv::group g(kReplicas, options);
    std::printf("distvals %s: a group of %d replicas on", dv::version_string, g.size());
    for (const dv::device& d : g.devices()) std::printf(" %s", d.str().c_str());
    std::printf("\n");

    int failures = check_results(g);
    std::printf("checked all-reduce from %d threads and from one thread: %s\n", kReplicas,
                failures == 0 ? "all results right" : "WRONG RESULTS");
    failures += bandwidth_table(g, max_bytes);
    if (failures != 0) {
      std::printf("%d checks failed\n", failures);
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distvals_example: %s\n", e.what());
    return 2;
  }
}
