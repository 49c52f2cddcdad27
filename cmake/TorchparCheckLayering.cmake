cmake_minimum_required(VERSION 3.22)
# Run at build time (cmake -P): fails the build when a file of libtorchpar includes a header of a
# layer above it or of a sibling strategy (../shared/DESIGN.md: lower layers never include higher
# ones; strategies share only through common/ and comm/).
# common/ is the lowest layer (pure utilities over ATen and the OS), then comm/, then the strategies and
# checkpoint/, then plan/.
# In: TORCHPAR_SOURCE_ROOT (csrc), TORCHPAR_LAYERING_STAMP (touched when every include is allowed).
set(allowed_common common)
set(allowed_comm common comm)
set(allowed_ddp common comm ddp)
set(allowed_sharded common comm sharded)
set(allowed_pipeline common comm pipeline)
set(allowed_ps common comm ps)
set(allowed_tensor_parallel common comm tensor_parallel)
set(allowed_checkpoint common comm checkpoint)
set(allowed_plan common comm ddp pipeline ps sharded tensor_parallel plan)

file(GLOB_RECURSE sources RELATIVE "${TORCHPAR_SOURCE_ROOT}/torchpar"
     "${TORCHPAR_SOURCE_ROOT}/torchpar/*.h" "${TORCHPAR_SOURCE_ROOT}/torchpar/*.cpp")
set(violations "")
foreach(source IN LISTS sources)
  string(REGEX MATCH "^[^/]+" layer "${source}")
  if(NOT DEFINED allowed_${layer})
    continue() # bindings/ (glue over everything), torchpar.h (the umbrella), pch.h
  endif()
  file(STRINGS "${TORCHPAR_SOURCE_ROOT}/torchpar/${source}" includes REGEX "^#include <torchpar/[^>]+>")
  foreach(line IN LISTS includes)
    string(REGEX REPLACE "^#include <torchpar/([^/>]+)/.*" "\\1" included_layer "${line}")
    if(NOT included_layer IN_LIST allowed_${layer})
      string(REGEX REPLACE "^#include <([^>]+)>.*" "\\1" header "${line}")
      list(JOIN allowed_${layer} ", " allowed)
      list(APPEND violations "  csrc/torchpar/${source} includes ${header} (${layer}/ may include only ${allowed})")
    endif()
  endforeach()
endforeach()
if(violations)
  list(JOIN violations "\n" text)
  message(FATAL_ERROR "torchpar: includes against the layering (../shared/DESIGN.md):\n${text}\n"
                      "Move what two layers share down into common/ or comm/.")
endif()
file(TOUCH "${TORCHPAR_LAYERING_STAMP}")
