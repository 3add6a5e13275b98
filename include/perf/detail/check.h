// perf/detail/check.h — checking the options that count things. They are size_t,
// as LibTorch's own (DataLoaderOptions), so a negative int given to one arrives
// as a huge count; it is refused as what it was. Internal to perf.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <limits>

namespace perf::detail {

// Refuses a count below `min`, or a negative one converted to size_t, naming the setting.
inline void check_count(size_t value, size_t min, const char* setting) {
  TORCH_CHECK(value <= static_cast<size_t>(std::numeric_limits<int64_t>::max()), setting, " must be >= ", min, ", got ",
              static_cast<int64_t>(value), " (a negative value, converted to size_t)");
  TORCH_CHECK(value >= min, setting, " must be >= ", min, ", got ", value);
}

}  // namespace perf::detail
