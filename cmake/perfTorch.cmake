# Attaches LibTorch to perf's INTERFACE target and decides PERF_WITH_CUDA.
# Used by perf's own CMakeLists.txt and by the installed perfConfig.cmake, so
# a consumer always gets the flags of the LibTorch it builds against.
#
#   perf_attach_torch(<target> <BUILD_INTERFACE|PLAIN>)
#
# Expects find_package(Torch) to have run. PERF_WITH_CUDA (ON by default) can
# be set OFF to compile perf's CUDA code out even with a CUDA LibTorch.
function(perf_attach_torch target mode)
  if(NOT DEFINED PERF_WITH_CUDA)
    set(PERF_WITH_CUDA ON)
  endif()
  if(PERF_WITH_CUDA AND (C10_CUDA_LIBRARY OR TORCH_CUDA_LIBRARIES))
    set(cuda 1)
  else()
    set(cuda 0)
  endif()
  if(mode STREQUAL "BUILD_INTERFACE")
    target_link_libraries(${target} INTERFACE "$<BUILD_INTERFACE:${TORCH_LIBRARIES}>")
    target_compile_definitions(${target} INTERFACE "$<BUILD_INTERFACE:PERF_WITH_CUDA=${cuda}>")
  else()
    target_link_libraries(${target} INTERFACE ${TORCH_LIBRARIES})
    target_compile_definitions(${target} INTERFACE PERF_WITH_CUDA=${cuda})
  endif()
  set(PERF_CUDA_ENABLED ${cuda} PARENT_SCOPE)
endfunction()
