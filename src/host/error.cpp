#include "mla/error.h"

namespace mla {

void throw_bad_argument(const std::string& argument, const std::string& expected, const std::string& got) {
  throw Error(argument + ": expected " + expected + ", got " + got);
}

}  // namespace mla
