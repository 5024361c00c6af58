// EXPECT(cond, fmt, ...) for the C++ tests: a failed check prints where and why, and is counted in
// `failures`, which the test's main() reports and turns into its exit status.
#pragma once

#include <cstdio>

inline int failures = 0;

#define EXPECT(cond, ...)                                                                          \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            std::fprintf(stderr, "%s:%d: FAILED: %s: ", __FILE__, __LINE__, #cond);                \
            std::fprintf(stderr, __VA_ARGS__);                                                     \
            std::fprintf(stderr, "\n");                                                            \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)
