/* profile.c -- the device profile's figures: their declaration (SPY_PROFILE_FIGURES in
 * spyre.h) as a table for the Python loader, and the range check every device open makes,
 * both read from that one declaration. */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "internal.h"

static const spy_figure figures[] = {
#define DESCRIBE(type, field, key, unit, scale, sign, max)                                         \
    {#field, key, unit, SPY_FIGURE_##type, SPY_FIGURE_##sign, offsetof(spy_profile, field),        \
     (double)(scale), (double)(max)},
    SPY_PROFILE_FIGURES(DESCRIBE)
#undef DESCRIBE
};

spy_status spy_profile_figures(const spy_figure **out, uint32_t *n)
{
    if (!out || !n)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null output");
    *out = figures;
    *n = (uint32_t)SPY_ARRAY_LEN(figures);
    return SPY_OK;
}

static double value_of(const spy_profile *p, const spy_figure *f)
{
    const char *at = (const char *)p + f->offset;
    switch (f->type) {
    case SPY_FIGURE_U32: { uint32_t v; memcpy(&v, at, sizeof v); return v; }
    case SPY_FIGURE_U64: { uint64_t v; memcpy(&v, at, sizeof v); return (double)v; }
    default: { double v; memcpy(&v, at, sizeof v); return v; }
    }
}

spy_status spy_profile_check(const spy_profile *p)
{
    if (!p)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null profile");
    for (size_t i = 0; i < SPY_ARRAY_LEN(figures); i++) {
        const spy_figure *f = &figures[i];
        double v = value_of(p, f);
        if (f->sign == SPY_FIGURE_POSITIVE && (!(v > 0) || !isfinite(v)))
            return spy_fail(SPY_E_PROFILE, -1, "profile figure %s must be positive", f->field);
        if (f->sign == SPY_FIGURE_NONNEGATIVE && (!(v >= 0) || !isfinite(v)))
            return spy_fail(SPY_E_PROFILE, -1, "profile figure %s must not be negative", f->field);
        if (v > f->max)
            return spy_fail(SPY_E_PROFILE, -1, "profile figure %s (%.17g) is above %.17g", f->field,
                            v, f->max);
    }
    if (p->stick_bytes & (p->stick_bytes - 1))
        return spy_fail(SPY_E_PROFILE, -1, "profile figure stick_bytes is not a power of two");
    return SPY_OK;
}
