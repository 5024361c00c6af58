/* Links an installed gradacc, checks that the library it runs with is the version its header
 * announces, and drives one object through create / use / destroy. */
#include <gradacc.h>

#include <stdio.h>
#include <string.h>

static int check(gradacc_status_t status, const char *what) {
    if (status != GRADACC_STATUS_OK) {
        fprintf(stderr, "%s: %s (%s)\n", what, gradacc_status_string(status), gradacc_last_error());
        return 1;
    }
    return 0;
}

int main(void) {
    const char *runtime = gradacc_version_string();
    const unsigned long number = (unsigned long)gradacc_version_number();
    const unsigned long expected =
        GRADACC_VERSION_MAJOR * 10000UL + GRADACC_VERSION_MINOR * 100UL + GRADACC_VERSION_PATCH;
    if (expected != (unsigned long)GRADACC_VERSION_NUMBER) {
        fprintf(stderr, "GRADACC_VERSION_NUMBER %lu differs from the version macros\n", (unsigned long)GRADACC_VERSION_NUMBER);
        return 1;
    }
    printf("gradacc header %s, library %s (%lu)\n", GRADACC_VERSION_STRING,
           runtime ? runtime : "(null)", number);
    if (runtime == NULL || strcmp(runtime, GRADACC_VERSION_STRING) != 0 || number != expected) {
        fprintf(stderr, "run-time version differs from the header's GRADACC_VERSION_* (%lu)\n", expected);
        return 1;
    }

    gradacc_scaler_config_t config;
    gradacc_scaler_t *scaler = NULL;
    float scale = 0.0f;
    if (check(gradacc_scaler_config_default(&config), "gradacc_scaler_config_default") ||
        check(gradacc_scaler_create(&config, NULL, &scaler), "gradacc_scaler_create") ||
        check(gradacc_scaler_scale(scaler, &scale), "gradacc_scaler_scale")) {
        return 1;
    }
    if (scale != config.init_scale) {
        fprintf(stderr, "scale %g, expected init_scale %g\n", scale, config.init_scale);
        return 1;
    }
    return check(gradacc_scaler_destroy(scaler), "gradacc_scaler_destroy");
}
