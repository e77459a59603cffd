#include "distvals/error.hpp"

#include <string>

namespace distvals::detail {

void throw_expects(const char* condition, const char* file, int line, const std::string& message) {
  throw invalid_argument_error(message + " (" + condition + " failed at " + file + ":" +
                               std::to_string(line) + ")");
}

}  // namespace distvals::detail
