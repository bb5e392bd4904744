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

// Expects `call` to throw an mla::Error whose message contains `text` (the message is printed if not).
#define EXPECT_ERROR_HAS(call, text)                                    \
  do {                                                                  \
    const std::string message_ = ::mla::test::error_of([&] { call; });  \
    EXPECT_NE(message_.find(text), std::string::npos) << message_;      \
  } while (0)
