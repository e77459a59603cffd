// distvals::reduce_on_caller: the CPU kernels of the engine, called without a group.
#include "distvals/host_reduce.hpp"

#include <string>

#include "distvals/error.hpp"
#include "kernels.hpp"
#include "validate.hpp"

namespace distvals {

void reduce_on_caller(dtype type, reduce_op op, const void* const* srcs, int nsrc, void* const* dsts, int ndst,
                      std::size_t count, int mean_divisor) {
  // 1. Every argument checked before any element is written.
  auto refuse = [](const std::string& why) { throw invalid_argument_error("reduce_on_caller: " + why); };
  // The enums first: they index the kernel table (a value past its end would run
  // whatever lies there).
  detail::check_dtype_and_op(type, op);
  if (nsrc < 1) refuse("needs at least one source, got " + std::to_string(nsrc));
  if (ndst < 1) refuse("needs at least one destination, got " + std::to_string(ndst));
  if (op == reduce_op::mean) {
    if (!is_floating(type)) refuse(std::string("mean of ") + dtype_name(type) + " is not defined");
    if (mean_divisor < 1) refuse("mean needs a divisor of at least 1, got " + std::to_string(mean_divisor));
  }
  if (count == 0) return;
  for (int i = 0; i < nsrc; ++i) {
    if (srcs[i] == nullptr) refuse("source " + std::to_string(i) + " is null");
  }
  for (int i = 0; i < ndst; ++i) {
    if (dsts[i] == nullptr) refuse("destination " + std::to_string(i) + " is null");
  }
  // 2. One pass of the kernel a group's replica would run over its whole slice.
  const cpu::reduce_args args{dsts, ndst, srcs, nsrc, count, op == reduce_op::mean ? double(mean_divisor) : 0.0};
  cpu::kernels().reduce[static_cast<int>(type)][cpu::op_index(op)](args);
}

}  // namespace distvals
