# distvals_apply_sanitizers(target): compile and link `target` with the sanitizers named
# in DISTVALS_SANITIZE (e.g. "address,undefined" or "thread"). Per target, never global.
function(distvals_apply_sanitizers target)
  if(DISTVALS_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=${DISTVALS_SANITIZE} -fno-omit-frame-pointer -g)
    target_link_options(${target} PRIVATE -fsanitize=${DISTVALS_SANITIZE})
    if(DISTVALS_SANITIZE MATCHES "undefined")
      target_compile_options(${target} PRIVATE -fno-sanitize-recover=undefined)
    endif()
  endif()
endfunction()

# distvals_warnings(target): the warning set every distvals target builds with.
function(distvals_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
  endif()
endfunction()
