#include <perf/perf.h>

#include <iostream>
#include <string>

int main(int argc, char** argv) {
  const perf::Report r = perf::setup();
  std::cout << r;
  const int expect_cuda = argc > 1 ? std::atoi(argv[1]) : -1;
  if (expect_cuda >= 0 && expect_cuda != PERF_WITH_CUDA) {
    std::cerr << "PERF_WITH_CUDA=" << PERF_WITH_CUDA << ", expected " << expect_cuda << "\n";
    return 1;
  }
#ifdef PERF_SEPARATE_COMPILATION
  const std::string mode = "static";  // perf::perf_static: perf::setup() comes from the library
#else
  const std::string mode = "header-only";
#endif
  if (argc > 2 && mode != argv[2]) {
    std::cerr << "built " << mode << ", expected " << argv[2] << "\n";
    return 1;
  }
  if (r.at("matmul_precision").read_back != "high") return 1;
  std::cout << "consumer ok (" << mode << ", PERF_WITH_CUDA=" << PERF_WITH_CUDA << ")\n";
  return 0;
}
