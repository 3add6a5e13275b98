// perf/detail/float.h — exact floating-point comparisons that are meant. perf
// compares values exactly where exactness is the point: an option left at its
// default, a divisor of exactly 1, a weight decay of exactly 0, no inf found.
// std::equal_to keeps IEEE semantics (NaN is unequal to itself) and keeps a
// project that builds with -Wfloat-equal free of warnings on perf's lines.
// Internal to perf.
#pragma once

#include <functional>

namespace perf::detail {

template <class T>
constexpr bool same_value(const T& a, const T& b) {
  return std::equal_to<T>()(a, b);
}

}  // namespace perf::detail
