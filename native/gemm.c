/* gemm.c -- the systolic arrays' arithmetic: C[m,n] (+)= op(A)[m,k] op(B)[k,n].
 *
 * Operands are fp16, bf16 or fp32 in the scratchpad; products accumulate in fp32, as on
 * the card. The simulator must not be the bottleneck of a functional run, so this is a
 * small BLIS-style kernel: operands are converted while packed into fp32 panels (MR rows
 * of A, NR columns of B), and a 6x16 AVX2/FMA micro-kernel does the arithmetic; a
 * portable micro-kernel is used where AVX2 is missing. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define MR 6
#define NR 16
#define KC 256
#define MC 96
#define NC 2048

typedef struct operand {
    const uint8_t *base;
    uint32_t dtype;
    uint64_t row_stride; /* elements between logical rows */
    uint64_t col_stride; /* elements between logical columns */
} operand;

/* Read n elements starting at logical (r, c) along the columns (dir 0) or rows (dir 1). */
static void read_run(const operand *o, uint64_t r, uint64_t c, size_t n, int along_rows, float *out)
{
    uint64_t step = along_rows ? o->row_stride : o->col_stride;
    uint64_t first = r * o->row_stride + c * o->col_stride;
    switch (o->dtype) {
    case SPY_DT_F32: {
        const float *p = (const float *)o->base + first;
        if (step == 1)
            memcpy(out, p, n * 4);
        else
            for (size_t i = 0; i < n; i++)
                out[i] = p[i * step];
        break;
    }
    case SPY_DT_F16: {
        const uint16_t *p = (const uint16_t *)o->base + first;
        if (step == 1)
            spy_f16_to_f32_n(p, out, n);
        else
            for (size_t i = 0; i < n; i++)
                out[i] = spy_f16_to_f32(p[i * step]);
        break;
    }
    default: { /* BF16 */
        const uint16_t *p = (const uint16_t *)o->base + first;
        for (size_t i = 0; i < n; i++)
            out[i] = spy_bf16_to_f32(p[i * step]);
        break;
    }
    }
}

/* Pack rows [i0, i0+mc) x cols [p0, p0+kc) of A into MR-row panels, zero padded. */
static void pack_a(const operand *a, uint64_t i0, uint32_t mc, uint64_t p0, uint32_t kc, float *dst,
                   float *tmp)
{
    for (uint32_t ip = 0; ip < mc; ip += MR) {
        float *panel = dst + (size_t)ip * kc;
        uint32_t rows = mc - ip < MR ? mc - ip : MR;
        if (rows < MR)
            memset(panel, 0, sizeof(float) * MR * kc);
        for (uint32_t r = 0; r < rows; r++) {
            read_run(a, i0 + ip + r, p0, kc, 0, tmp);
            for (uint32_t p = 0; p < kc; p++)
                panel[p * MR + r] = tmp[p];
        }
    }
}

/* Pack rows [p0, p0+kc) x cols [j0, j0+nc) of B into NR-column panels, zero padded. */
static void pack_b(const operand *b, uint64_t p0, uint32_t kc, uint64_t j0, uint32_t nc, float *dst,
                   float *tmp)
{
    bool rows_contiguous = b->col_stride == 1;
    for (uint32_t jp = 0; jp < nc; jp += NR) {
        float *panel = dst + (size_t)jp * kc;
        uint32_t cols = nc - jp < NR ? nc - jp : NR;
        if (cols < NR)
            memset(panel, 0, sizeof(float) * NR * kc);
        if (rows_contiguous) {
            for (uint32_t p = 0; p < kc; p++)
                read_run(b, p0 + p, j0 + jp, cols, 0, panel + (size_t)p * NR);
        } else {
            for (uint32_t c = 0; c < cols; c++) {
                read_run(b, p0, j0 + jp + c, kc, 1, tmp);
                for (uint32_t p = 0; p < kc; p++)
                    panel[p * NR + c] = tmp[p];
            }
        }
    }
}

static void kernel_portable(uint32_t kc, const float *a, const float *b, float *c, uint64_t ldc,
                            uint32_t rows, uint32_t cols)
{
    float acc[MR][NR] = {{0}};
    for (uint32_t p = 0; p < kc; p++)
        for (int r = 0; r < MR; r++)
            for (int j = 0; j < NR; j++)
                acc[r][j] += a[p * MR + r] * b[p * NR + j];
    for (uint32_t r = 0; r < rows; r++)
        for (uint32_t j = 0; j < cols; j++)
            c[r * ldc + j] += acc[r][j];
}

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2,fma"))) static void kernel_avx2(uint32_t kc, const float *a,
                                                             const float *b, float *c, uint64_t ldc,
                                                             uint32_t rows, uint32_t cols)
{
    __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
    __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
    __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
    __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
    __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
    __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
    for (uint32_t p = 0; p < kc; p++) {
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), av;
        av = _mm256_broadcast_ss(a + 0);
        c00 = _mm256_fmadd_ps(av, b0, c00);
        c01 = _mm256_fmadd_ps(av, b1, c01);
        av = _mm256_broadcast_ss(a + 1);
        c10 = _mm256_fmadd_ps(av, b0, c10);
        c11 = _mm256_fmadd_ps(av, b1, c11);
        av = _mm256_broadcast_ss(a + 2);
        c20 = _mm256_fmadd_ps(av, b0, c20);
        c21 = _mm256_fmadd_ps(av, b1, c21);
        av = _mm256_broadcast_ss(a + 3);
        c30 = _mm256_fmadd_ps(av, b0, c30);
        c31 = _mm256_fmadd_ps(av, b1, c31);
        av = _mm256_broadcast_ss(a + 4);
        c40 = _mm256_fmadd_ps(av, b0, c40);
        c41 = _mm256_fmadd_ps(av, b1, c41);
        av = _mm256_broadcast_ss(a + 5);
        c50 = _mm256_fmadd_ps(av, b0, c50);
        c51 = _mm256_fmadd_ps(av, b1, c51);
        a += MR;
        b += NR;
    }
    __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    if (rows == MR && cols == NR) {
        for (int r = 0; r < MR; r++) {
            float *cr = c + r * ldc;
            _mm256_storeu_ps(cr, _mm256_add_ps(_mm256_loadu_ps(cr), acc[r][0]));
            _mm256_storeu_ps(cr + 8, _mm256_add_ps(_mm256_loadu_ps(cr + 8), acc[r][1]));
        }
        return;
    }
    float tmp[NR];
    for (uint32_t r = 0; r < rows; r++) {
        _mm256_storeu_ps(tmp, acc[r][0]);
        _mm256_storeu_ps(tmp + 8, acc[r][1]);
        for (uint32_t j = 0; j < cols; j++)
            c[r * ldc + j] += tmp[j];
    }
}

static bool have_avx2(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else
static bool have_avx2(void) { return false; }
#endif

/* The panels are made on the first matmul and kept until the device closes. */
static bool ensure_panels(spy_gemm_panels *p)
{
    if (!p->a)
        p->a = aligned_alloc(64, sizeof(float) * MC * KC);
    if (!p->b)
        p->b = aligned_alloc(64, sizeof(float) * (size_t)NC * KC);
    if (!p->tmp)
        p->tmp = malloc(sizeof(float) * (KC > NC ? KC : NC));
    return p->a && p->b && p->tmp;
}

void spy_gemm_panels_free(spy_gemm_panels *p)
{
    free(p->a);
    free(p->b);
    free(p->tmp);
    memset(p, 0, sizeof *p);
}

void spy_gemm(const spy_matmul *mm, const uint8_t *lx_a, const uint8_t *lx_b, uint8_t *lx_c,
              bool accumulate, bool trans_a, bool trans_b, spy_gemm_panels *bufs)
{
    float *c = (float *)lx_c;
    uint64_t ldc = mm->ldc;
    if (!accumulate)
        for (uint32_t i = 0; i < mm->m; i++)
            memset(c + i * ldc, 0, sizeof(float) * mm->n);
    operand a = {lx_a, mm->a_dtype, trans_a ? 1 : mm->lda, trans_a ? mm->lda : 1};
    operand b = {lx_b, mm->b_dtype, trans_b ? 1 : mm->ldb, trans_b ? mm->ldb : 1};
    if (!ensure_panels(bufs)) {
        /* No host memory for panels: fall back to the direct loop (slow, still exact). */
        float x, y;
        for (uint32_t i = 0; i < mm->m; i++)
            for (uint32_t j = 0; j < mm->n; j++) {
                float s = 0;
                for (uint32_t p = 0; p < mm->k; p++) {
                    read_run(&a, i, p, 1, 0, &x);
                    read_run(&b, p, j, 1, 0, &y);
                    s += x * y;
                }
                c[i * ldc + j] += s;
            }
        return;
    }
    bool fast = have_avx2();
    for (uint32_t jc = 0; jc < mm->n; jc += NC) {
        uint32_t nc = mm->n - jc < NC ? mm->n - jc : NC;
        for (uint32_t pc = 0; pc < mm->k; pc += KC) {
            uint32_t kc = mm->k - pc < KC ? mm->k - pc : KC;
            pack_b(&b, pc, kc, jc, nc, bufs->b, bufs->tmp);
            for (uint32_t ic = 0; ic < mm->m; ic += MC) {
                uint32_t mc = mm->m - ic < MC ? mm->m - ic : MC;
                pack_a(&a, ic, mc, pc, kc, bufs->a, bufs->tmp);
                for (uint32_t jr = 0; jr < nc; jr += NR) {
                    uint32_t cols = nc - jr < NR ? nc - jr : NR;
                    for (uint32_t ir = 0; ir < mc; ir += MR) {
                        uint32_t rows = mc - ir < MR ? mc - ir : MR;
                        float *cc = c + (uint64_t)(ic + ir) * ldc + jc + jr;
                        const float *ap = bufs->a + (size_t)ir * kc;
                        const float *bp = bufs->b + (size_t)jr * kc;
#if defined(__x86_64__)
                        if (fast) {
                            kernel_avx2(kc, ap, bp, cc, ldc, rows, cols);
                            continue;
                        }
#endif
                        kernel_portable(kc, ap, bp, cc, ldc, rows, cols);
                    }
                }
            }
        }
    }
}
