// The message of the mla::Error a call throws ("no error" if it throws none), for tests that check
// what a rejected argument is told.
#pragma once

#include <functional>
#include <string>

#include "mla/error.h"

namespace mla::test {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace mla::test
