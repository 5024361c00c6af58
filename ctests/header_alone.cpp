// gradacc.h must compile on its own as strict ISO C++17 (-std=c++17 -pedantic -Werror), be safe to
// include twice, declare its functions with C linkage, and carry version macros that agree.
#include "gradacc.h"
#include "gradacc.h"

#include <cstdio>
#include <cstring>

#define STR_(x) #x
#define STR(x) STR_(x)

static_assert(GRADACC_VERSION_MAJOR >= 0 && GRADACC_VERSION_MINOR >= 0 && GRADACC_VERSION_PATCH >= 0,
              "gradacc version macros must be non-negative integers");

int main() {
    const char *numbers =
        STR(GRADACC_VERSION_MAJOR) "." STR(GRADACC_VERSION_MINOR) "." STR(GRADACC_VERSION_PATCH);
    // The string may carry a pre-release suffix ("0.2.0-rc.1"), never different numbers.
    const std::size_t n = std::strlen(numbers);
    const char *full = GRADACC_VERSION_STRING;
    if (std::strncmp(full, numbers, n) != 0 || (full[n] != '\0' && full[n] != '-')) {
        std::fprintf(stderr, "GRADACC_VERSION_STRING \"%s\" does not match %s\n", full, numbers);
        return 1;
    }
    // Linking this call proves the functions are declared extern "C" (a C++ name would not resolve).
    std::printf("gradacc.h %s compiles alone as C++17; library %s\n", full, gradacc_version_string());
    return 0;
}
