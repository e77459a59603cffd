/// @file
/// Symbol visibility for the distvals library.
///
/// The library is built with hidden visibility; only names marked DISTVALS_EXPORT
/// form its ABI. A static build (DISTVALS_STATIC defined by the CMake target's
/// interface) needs no decoration at all.
///
/// @def DISTVALS_EXPORT
/// Marks a function or class as part of the library's exported ABI.
#pragma once

#if defined(DISTVALS_STATIC)
#define DISTVALS_EXPORT
#elif defined(_WIN32)
#if defined(DISTVALS_BUILDING)
#define DISTVALS_EXPORT __declspec(dllexport)
#else
#define DISTVALS_EXPORT __declspec(dllimport)
#endif
#else
#define DISTVALS_EXPORT __attribute__((visibility("default")))
#endif
