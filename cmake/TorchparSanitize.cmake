# TORCHPAR_SANITIZE=address,undefined (or thread): every torchpar target compiled and linked with
# those sanitizers. libtorch itself stays uninstrumented; scripts/sanitize.sh runs the tests so.
if(TORCHPAR_SANITIZE)
  # A report must fail the test that caused it, so UBSan stops instead of printing and going on. -O1 (after
  # the build type's -O3, so it wins): the level the sanitizers' documentation suggests, and CI builds both
  # kinds cold: the DDP reducer's translation unit under ASan took 14 s of CPU against 23 at -O3.
  add_compile_options(-fsanitize=${TORCHPAR_SANITIZE} -fno-sanitize-recover=all -fno-omit-frame-pointer -g1 -O1)
  add_link_options(-fsanitize=${TORCHPAR_SANITIZE})
  message(STATUS "torchpar: sanitizers ${TORCHPAR_SANITIZE}")
endif()
