/* half.h -- bulk fp16 conversion helpers shared by the arithmetic kernels. */
#ifndef SPYRE_HALF_H
#define SPYRE_HALF_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

bool spy_cpu_f16c(void);
void spy_f16_to_f32_n(const uint16_t *s, float *d, size_t n);
void spy_f32_to_f16_n(const float *s, uint16_t *d, size_t n);
#endif
