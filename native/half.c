/* half.c -- fp16 and bf16 conversions (round to nearest even), scalar and bulk. */
#include <string.h>

#include "internal.h"

float spy_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                mant <<= 1;
            } while (!(mant & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t spy_f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xff, mant = x & 0x7fffff;
    if (exp == 0xff)
        return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 | (mant >> 13) : 0));
    int e = (int)exp - 127 + 15;
    if (e >= 31)
        return (uint16_t)(sign | 0x7c00);
    if (e <= 0) {
        if (e < -10)
            return (uint16_t)sign;
        mant |= 0x800000;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t half = mant >> shift, rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)e << 10) | (mant >> 13), rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1)))
        half++;
    return (uint16_t)(sign | half);
}

float spy_bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t spy_f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7f800000u) == 0x7f800000u && (x & 0x7fffff))
        return (uint16_t)((x >> 16) | 0x40); /* quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

#if defined(__x86_64__)
#include <immintrin.h>

/* libgcc reads the CPU's features once, before main: no state of our own to race on. */
static bool cpu_f16c(void) { return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx"); }

__attribute__((target("f16c,avx"))) static void f16_to_f32_x86(const uint16_t *s, float *d, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++)
        d[i] = spy_f16_to_f32(s[i]);
}

__attribute__((target("f16c,avx"))) static void f32_to_f16_x86(const float *s, uint16_t *d, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        d[i] = spy_f32_to_f16(s[i]);
}
#endif

void spy_f16_to_f32_n(const uint16_t *s, float *d, size_t n)
{
#if defined(__x86_64__)
    if (cpu_f16c()) {
        f16_to_f32_x86(s, d, n);
        return;
    }
#endif
    for (size_t i = 0; i < n; i++)
        d[i] = spy_f16_to_f32(s[i]);
}

void spy_f32_to_f16_n(const float *s, uint16_t *d, size_t n)
{
#if defined(__x86_64__)
    if (cpu_f16c()) {
        f32_to_f16_x86(s, d, n);
        return;
    }
#endif
    for (size_t i = 0; i < n; i++)
        d[i] = spy_f32_to_f16(s[i]);
}
