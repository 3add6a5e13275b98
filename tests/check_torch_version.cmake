# cmake -DVERSION=x.y.z -P check_torch_version.cmake: perf's LibTorch floor check alone.
include(${CMAKE_CURRENT_LIST_DIR}/../cmake/perfTorch.cmake)
perf_check_torch_version("${VERSION}")
message(STATUS "LibTorch ${VERSION} accepted")
