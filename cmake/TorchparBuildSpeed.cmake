# ccache for every compile. The sloppiness lets ccache cache translation units that use a
# precompiled header (it would otherwise refuse them and every rebuild would recompile). The base
# directory makes paths inside the checkout relative in what ccache hashes, so that another clone (CI's
# fresh one) finds what this one compiled.
find_program(TORCHPAR_CCACHE ccache)
if(TORCHPAR_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER
    "${CMAKE_COMMAND};-E;env;CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime;CCACHE_BASEDIR=${CMAKE_SOURCE_DIR};${TORCHPAR_CCACHE}")
  message(STATUS "torchpar: compiling through ccache (${TORCHPAR_CCACHE})")
endif()
