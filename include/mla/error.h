// The one error type of the library. Every rejected input throws it before anything is written.
#pragma once

#include <stdexcept>
#include <string>

namespace mla {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Throws Error("<argument>: expected <expected>, got <got>"), the one format every check uses so that
// a user always learns which argument was wrong and both values.
[[noreturn]] void throw_bad_argument(const std::string& argument, const std::string& expected,
                                     const std::string& got);

}  // namespace mla
