# strata_options: the compile options every strata target uses.
add_library(strata_options INTERFACE)
target_include_directories(strata_options INTERFACE ${PROJECT_SOURCE_DIR})
target_compile_options(strata_options INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -fno-math-errno>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${STRATA_WERROR}>>:-Werror>)
if(STRATA_TSAN)
  target_compile_options(strata_options INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=thread -g>)
  target_link_options(strata_options INTERFACE -fsanitize=thread)
endif()
if(STRATA_HAVE_CUDA)
  target_compile_definitions(strata_options INTERFACE STRATA_HAVE_CUDA=1)
endif()
