/* sfu.c -- the special-function units: the op table of sfu_ops.h, its implementations,
 * and running and costing one instruction.
 *
 * An instruction covers rows x cols elements. Each row is staged into fp32 (the float
 * domain) or int64 (the integer domain, booleans included) scratch rows, computed by the
 * op's implementation for that domain -- one tight loop -- and written back rounded to
 * the destination dtype; the op's kind (sfu_ops.h) says which domain and what shape of
 * result. Integer arithmetic wraps (two's complement) instead of overflowing, and integer
 * division by zero yields 0, so no input can make the simulator misbehave. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static bool is_float(uint32_t dt) { return dt == SPY_DT_F32 || dt == SPY_DT_F16 || dt == SPY_DT_BF16; }

static bool ensure(spy_sfu_rows *rb, size_t n)
{
    if (n <= rb->cap)
        return true;
    for (int k = 0; k < 4; k++) {
        float *f = realloc(rb->f[k], n * sizeof(float));
        if (f)
            rb->f[k] = f;
        int64_t *i = realloc(rb->i[k], n * sizeof(int64_t));
        if (i)
            rb->i[k] = i;
        if (!f || !i)
            return false;
    }
    rb->cap = n;
    return true;
}

void spy_sfu_rows_free(spy_sfu_rows *rb)
{
    for (int k = 0; k < 4; k++) {
        free(rb->f[k]);
        free(rb->i[k]);
    }
    memset(rb, 0, sizeof *rb);
}

/* Address of element (r, c) of an operand. */
static uint8_t *at(uint8_t *lx, const spy_operand *o, uint32_t r, uint32_t c)
{
    uint64_t es = spy_dtype_size(o->dtype);
    switch (o->kind) {
    case SPY_OPND_TILE: return lx + o->v.off + ((uint64_t)r * o->pitch + c) * es;
    case SPY_OPND_ROW: return lx + o->v.off + (uint64_t)r * o->pitch * es;
    case SPY_OPND_COL: return lx + o->v.off + (uint64_t)c * es;
    default: return lx + o->v.off;
    }
}

static float load_f(const uint8_t *p, uint32_t dt)
{
    switch (dt) {
    case SPY_DT_F32: { float v; memcpy(&v, p, 4); return v; }
    case SPY_DT_F16: { uint16_t v; memcpy(&v, p, 2); return spy_f16_to_f32(v); }
    case SPY_DT_BF16: { uint16_t v; memcpy(&v, p, 2); return spy_bf16_to_f32(v); }
    case SPY_DT_I64: { int64_t v; memcpy(&v, p, 8); return (float)v; }
    case SPY_DT_I32: { int32_t v; memcpy(&v, p, 4); return (float)v; }
    case SPY_DT_I8: return (float)(int8_t)p[0];
    default: return (float)p[0];
    }
}

static int64_t f2i(float v)
{
    if (isnan(v))
        return 0;
    if (v >= 9.2233720368547758e18f)
        return INT64_MAX;
    if (v <= -9.2233720368547758e18f)
        return INT64_MIN;
    return (int64_t)v;
}

static int64_t load_i(const uint8_t *p, uint32_t dt)
{
    switch (dt) {
    case SPY_DT_I64: { int64_t v; memcpy(&v, p, 8); return v; }
    case SPY_DT_I32: { int32_t v; memcpy(&v, p, 4); return v; }
    case SPY_DT_I8: return (int8_t)p[0];
    case SPY_DT_U8: return p[0];
    case SPY_DT_BOOL: return p[0] != 0;
    default: return f2i(load_f(p, dt));
    }
}

/* Stage operand row r into a float or int row of n = cols elements. */
static void stage_f(uint8_t *lx, const spy_operand *o, uint32_t r, uint32_t n, float *out)
{
    if (o->kind == SPY_OPND_IMM) {
        float v = is_float(o->dtype) ? (float)o->v.imm_f : (float)o->v.imm_i;
        for (uint32_t c = 0; c < n; c++)
            out[c] = v;
        return;
    }
    if (o->kind == SPY_OPND_ROW || o->kind == SPY_OPND_SCALAR) {
        float v = load_f(at(lx, o, r, 0), o->dtype);
        for (uint32_t c = 0; c < n; c++)
            out[c] = v;
        return;
    }
    uint8_t *p = at(lx, o, r, 0);
    if (o->dtype == SPY_DT_F32) {
        memcpy(out, p, (size_t)n * 4);
    } else if (o->dtype == SPY_DT_F16) {
        spy_f16_to_f32_n((const uint16_t *)(const void *)p, out, n);
    } else {
        uint32_t es = spy_dtype_size(o->dtype);
        for (uint32_t c = 0; c < n; c++)
            out[c] = load_f(p + (uint64_t)c * es, o->dtype);
    }
}

static void stage_i(uint8_t *lx, const spy_operand *o, uint32_t r, uint32_t n, int64_t *out)
{
    if (o->kind == SPY_OPND_IMM) {
        int64_t v = is_float(o->dtype) ? f2i((float)o->v.imm_f) : o->v.imm_i;
        for (uint32_t c = 0; c < n; c++)
            out[c] = v;
        return;
    }
    if (o->kind == SPY_OPND_ROW || o->kind == SPY_OPND_SCALAR) {
        int64_t v = load_i(at(lx, o, r, 0), o->dtype);
        for (uint32_t c = 0; c < n; c++)
            out[c] = v;
        return;
    }
    uint8_t *p = at(lx, o, r, 0);
    uint32_t es = spy_dtype_size(o->dtype);
    for (uint32_t c = 0; c < n; c++)
        out[c] = load_i(p + (uint64_t)c * es, o->dtype);
}

static void store_f(uint8_t *p, uint32_t dt, float v)
{
    switch (dt) {
    case SPY_DT_F32: memcpy(p, &v, 4); break;
    case SPY_DT_F16: { uint16_t h = spy_f32_to_f16(v); memcpy(p, &h, 2); break; }
    case SPY_DT_BF16: { uint16_t h = spy_f32_to_bf16(v); memcpy(p, &h, 2); break; }
    case SPY_DT_I64: { int64_t i = f2i(v); memcpy(p, &i, 8); break; }
    case SPY_DT_I32: { int32_t i = (int32_t)(uint32_t)(uint64_t)f2i(v); memcpy(p, &i, 4); break; }
    case SPY_DT_I8: case SPY_DT_U8: p[0] = (uint8_t)(uint64_t)f2i(v); break;
    default: p[0] = v != 0; break;
    }
}

static void store_i(uint8_t *p, uint32_t dt, int64_t v)
{
    switch (dt) {
    case SPY_DT_I64: memcpy(p, &v, 8); break;
    case SPY_DT_I32: { int32_t i = (int32_t)(uint32_t)(uint64_t)v; memcpy(p, &i, 4); break; }
    case SPY_DT_I8: case SPY_DT_U8: p[0] = (uint8_t)(uint64_t)v; break;
    case SPY_DT_BOOL: p[0] = v != 0; break;
    default: store_f(p, dt, (float)v); break;
    }
}

static void write_f(uint8_t *lx, const spy_instr *ins, uint32_t r, uint32_t n, const float *v)
{
    const spy_operand *d = &ins->dst;
    uint8_t *p = at(lx, d, r, 0);
    if (d->kind == SPY_OPND_TILE || d->kind == SPY_OPND_COL) {
        if (d->dtype == SPY_DT_F32) {
            memmove(p, v, (size_t)n * 4);
        } else if (d->dtype == SPY_DT_F16) {
            spy_f32_to_f16_n(v, (uint16_t *)(void *)p, n);
        } else {
            uint32_t es = spy_dtype_size(d->dtype);
            for (uint32_t c = 0; c < n; c++)
                store_f(p + (uint64_t)c * es, d->dtype, v[c]);
        }
    } else {
        store_f(p, d->dtype, v[n - 1]);
    }
}

static void write_i(uint8_t *lx, const spy_instr *ins, uint32_t r, uint32_t n, const int64_t *v)
{
    const spy_operand *d = &ins->dst;
    uint8_t *p = at(lx, d, r, 0);
    if (d->kind == SPY_OPND_TILE || d->kind == SPY_OPND_COL) {
        uint32_t es = spy_dtype_size(d->dtype);
        for (uint32_t c = 0; c < n; c++)
            store_i(p + (uint64_t)c * es, d->dtype, v[c]);
    } else {
        store_i(p, d->dtype, v[n - 1]);
    }
}

/* ---- the implementations named by the op table --------------------------------------
 * Per kind, one signature (n: the columns of a row):
 *   MAP, CAST  f_x(ins, n, out, a, b, c)     float out[n] from float rows a, b, c (int: i_x)
 *   TEST       f_x(ins, n, out, a, b)        int64 0/1 out[n] from float rows (int: i_x)
 *   REDUCE     f_x(ins, n, a, dst)           one value from row a, stored at dst
 *   IOTA       f_x(ins, r, n, out)           row r of the sequence */

/* An elementwise implementation: one loop of expr over the row's elements i. */
#define MAP(T, fn, expr)                                                                           \
    static void fn(const spy_instr *ins, uint32_t n, T *o, const T *a, const T *b, const T *c)     \
    {                                                                                              \
        for (uint32_t i = 0; i < n; i++)                                                           \
            o[i] = (expr);                                                                         \
    }
#define MAP_F(name, expr) MAP(float, f_##name, expr)
#define MAP_I(name, expr) MAP(int64_t, i_##name, expr)

static float gelu(float x, int tanh_form)
{
    if (tanh_form)
        return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
}

static float fremainder(float a, float b)
{
    float m = fmodf(a, b);
    return (m != 0 && ((m < 0) != (b < 0))) ? m + b : m;
}

MAP_F(zero, 0)
MAP_F(mov, a[i])
MAP_F(add, a[i] + b[i])
MAP_F(sub, a[i] - b[i])
MAP_F(mul, a[i] * b[i])
MAP_F(div, a[i] / b[i])
MAP_F(max, isnan(a[i]) || a[i] > b[i] ? a[i] : b[i])
MAP_F(min, isnan(a[i]) || a[i] < b[i] ? a[i] : b[i])
MAP_F(neg, -a[i])
MAP_F(abs, fabsf(a[i]))
MAP_F(exp, expf(a[i]))
MAP_F(log, logf(a[i]))
MAP_F(sqrt, sqrtf(a[i]))
MAP_F(rsqrt, 1.0f / sqrtf(a[i]))
MAP_F(tanh, tanhf(a[i]))
MAP_F(sigmoid, 1.0f / (1.0f + expf(-a[i])))
MAP_F(silu, a[i] / (1.0f + expf(-a[i])))
MAP_F(gelu, gelu(a[i], ins->aux))
MAP_F(pow, powf(a[i], b[i]))
MAP_F(select, a[i] != 0 ? b[i] : c[i])
MAP_F(sin, sinf(a[i]))
MAP_F(cos, cosf(a[i]))
MAP_F(recip, 1.0f / a[i])
MAP_F(floordiv, floorf(a[i] / b[i]))
MAP_F(mod, fmodf(a[i], b[i]))
MAP_F(remainder, fremainder(a[i], b[i]))
MAP_F(erf, erff(a[i]))
MAP_F(floor, floorf(a[i]))
MAP_F(ceil, ceilf(a[i]))
MAP_F(trunc, truncf(a[i]))
MAP_F(round, nearbyintf(a[i]))
MAP_F(sign, (float)((a[i] > 0) - (a[i] < 0)))
MAP_F(log1p, log1pf(a[i]))
MAP_F(expm1, expm1f(a[i]))
MAP_F(atan, atanf(a[i]))

static int64_t wrap_add(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }
static int64_t wrap_sub(int64_t a, int64_t b) { return (int64_t)((uint64_t)a - (uint64_t)b); }
static int64_t wrap_mul(int64_t a, int64_t b) { return (int64_t)((uint64_t)a * (uint64_t)b); }

static int64_t idiv_trunc(int64_t a, int64_t b)
{
    if (b == 0)
        return 0;
    if (b == -1)
        return wrap_sub(0, a);
    return a / b;
}

static int64_t imod_trunc(int64_t a, int64_t b)
{
    if (b == 0 || b == -1)
        return 0;
    return a % b;
}

static int64_t idiv_floor(int64_t a, int64_t b)
{
    int64_t q = idiv_trunc(a, b), r = imod_trunc(a, b);
    return (r != 0 && ((r < 0) != (b < 0))) ? q - 1 : q;
}

static int64_t imod_floor(int64_t a, int64_t b)
{
    int64_t r = imod_trunc(a, b);
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

static int64_t ipow(int64_t a, int64_t e)
{
    if (e < 0)
        return a == 1 ? 1 : (a == -1 ? ((e & 1) ? -1 : 1) : 0);
    int64_t r = 1;
    while (e) {
        if (e & 1)
            r = wrap_mul(r, a);
        a = wrap_mul(a, a);
        e >>= 1;
    }
    return r;
}

MAP_I(zero, 0)
MAP_I(mov, a[i])
MAP_I(add, wrap_add(a[i], b[i]))
MAP_I(sub, wrap_sub(a[i], b[i]))
MAP_I(mul, wrap_mul(a[i], b[i]))
MAP_I(div, idiv_trunc(a[i], b[i]))
MAP_I(floordiv, idiv_floor(a[i], b[i]))
MAP_I(mod, imod_trunc(a[i], b[i]))
MAP_I(remainder, imod_floor(a[i], b[i]))
MAP_I(max, a[i] > b[i] ? a[i] : b[i])
MAP_I(min, a[i] < b[i] ? a[i] : b[i])
MAP_I(neg, wrap_sub(0, a[i]))
MAP_I(abs, a[i] < 0 ? wrap_sub(0, a[i]) : a[i])
MAP_I(pow, ipow(a[i], b[i]))
MAP_I(and, a[i] & b[i])
MAP_I(or, a[i] | b[i])
MAP_I(xor, a[i] ^ b[i])
MAP_I(not, ins->dst.dtype == SPY_DT_BOOL ? a[i] == 0 : ~a[i])
MAP_I(sign, (a[i] > 0) - (a[i] < 0))
MAP_I(select, a[i] != 0 ? b[i] : c[i])

static bool cmp_f(uint32_t how, float a, float b)
{
    switch (how) {
    case SPY_CMP_EQ: return a == b;
    case SPY_CMP_NE: return a != b;
    case SPY_CMP_LT: return a < b;
    case SPY_CMP_LE: return a <= b;
    case SPY_CMP_GT: return a > b;
    default: return a >= b;
    }
}

static bool cmp_i(uint32_t how, int64_t a, int64_t b)
{
    switch (how) {
    case SPY_CMP_EQ: return a == b;
    case SPY_CMP_NE: return a != b;
    case SPY_CMP_LT: return a < b;
    case SPY_CMP_LE: return a <= b;
    case SPY_CMP_GT: return a > b;
    default: return a >= b;
    }
}

static void f_cmp(const spy_instr *ins, uint32_t n, int64_t *o, const float *a, const float *b)
{
    for (uint32_t i = 0; i < n; i++)
        o[i] = cmp_f(ins->aux, a[i], b[i]);
}

static void i_cmp(const spy_instr *ins, uint32_t n, int64_t *o, const int64_t *a, const int64_t *b)
{
    for (uint32_t i = 0; i < n; i++)
        o[i] = cmp_i(ins->aux, a[i], b[i]);
}

static void f_isnan(const spy_instr *ins, uint32_t n, int64_t *o, const float *a, const float *b)
{
    for (uint32_t i = 0; i < n; i++)
        o[i] = isnan(a[i]);
}

static void i_isnan(const spy_instr *ins, uint32_t n, int64_t *o, const int64_t *a, const int64_t *b)
{
    memset(o, 0, (size_t)n * sizeof *o);
}

static void f_signbit(const spy_instr *ins, uint32_t n, int64_t *o, const float *a, const float *b)
{
    for (uint32_t i = 0; i < n; i++)
        o[i] = signbit(a[i]) != 0;
}

static void i_signbit(const spy_instr *ins, uint32_t n, int64_t *o, const int64_t *a, const int64_t *b)
{
    for (uint32_t i = 0; i < n; i++)
        o[i] = a[i] < 0;
}

/* Float reductions accumulate sums and products in double; NaN wins max, min, argmax and
 * argmin (the first NaN's index). any/all test the integer conversion of each element. */
static void f_rsum(const spy_instr *ins, uint32_t n, const float *a, uint8_t *dst)
{
    double acc = 0.0;
    for (uint32_t i = 0; i < n; i++)
        acc = acc + a[i];
    store_f(dst, ins->dst.dtype, (float)acc);
}

static void f_rprod(const spy_instr *ins, uint32_t n, const float *a, uint8_t *dst)
{
    double acc = 1.0;
    for (uint32_t i = 0; i < n; i++)
        acc = acc * a[i];
    store_f(dst, ins->dst.dtype, (float)acc);
}

static void f_rmax(const spy_instr *ins, uint32_t n, const float *a, uint8_t *dst)
{
    float m = a[0];
    for (uint32_t i = 1; i < n && !isnan(m); i++)
        if (isnan(a[i]) || a[i] > m)
            m = a[i];
    store_f(dst, ins->dst.dtype, m);
}

static void f_rmin(const spy_instr *ins, uint32_t n, const float *a, uint8_t *dst)
{
    float m = a[0];
    for (uint32_t i = 1; i < n && !isnan(m); i++)
        if (isnan(a[i]) || a[i] < m)
            m = a[i];
    store_f(dst, ins->dst.dtype, m);
}

static void f_rargmax(const spy_instr *ins, uint32_t n, const float *a, uint8_t *dst)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < n && !isnan(a[best]); i++)
        if (isnan(a[i]) || a[i] > a[best])
            best = i;
    store_i(dst, ins->dst.dtype, best);
}

static void f_rargmin(const spy_instr *ins, uint32_t n, const float *a, uint8_t *dst)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < n && !isnan(a[best]); i++)
        if (isnan(a[i]) || a[i] < a[best])
            best = i;
    store_i(dst, ins->dst.dtype, best);
}

static void f_rany(const spy_instr *ins, uint32_t n, const float *a, uint8_t *dst)
{
    int64_t acc = 0;
    for (uint32_t i = 0; i < n; i++)
        acc |= f2i(a[i]) != 0;
    store_i(dst, ins->dst.dtype, acc);
}

static void f_rall(const spy_instr *ins, uint32_t n, const float *a, uint8_t *dst)
{
    int64_t acc = 1;
    for (uint32_t i = 0; i < n; i++)
        acc &= f2i(a[i]) != 0;
    store_i(dst, ins->dst.dtype, acc);
}

/* Integer reductions wrap like the integer arithmetic. */
#define REDUCE_I(name, init, first, update)                                                        \
    static void i_##name(const spy_instr *ins, uint32_t n, const int64_t *a, uint8_t *dst)         \
    {                                                                                              \
        int64_t acc = (init);                                                                      \
        for (uint32_t i = (first); i < n; i++)                                                     \
            update;                                                                                \
        store_i(dst, ins->dst.dtype, acc);                                                         \
    }

REDUCE_I(rsum, 0, 0, acc = wrap_add(acc, a[i]))
REDUCE_I(rprod, 1, 0, acc = wrap_mul(acc, a[i]))
REDUCE_I(rmax, a[0], 1, if (a[i] > acc) acc = a[i])
REDUCE_I(rmin, a[0], 1, if (a[i] < acc) acc = a[i])
REDUCE_I(rargmax, 0, 1, if (a[i] > a[acc]) acc = i)
REDUCE_I(rargmin, 0, 1, if (a[i] < a[acc]) acc = i)
REDUCE_I(rany, 0, 0, acc |= a[i] != 0)
REDUCE_I(rall, 1, 0, acc &= a[i] != 0)

static void f_iota(const spy_instr *ins, uint32_t r, uint32_t n, float *o)
{
    double base = ins->src[0].v.imm_f, rs = ins->src[1].v.imm_f, cs = ins->src[2].v.imm_f;
    for (uint32_t c = 0; c < n; c++)
        o[c] = (float)(base + r * rs + c * cs);
}

static void i_iota(const spy_instr *ins, uint32_t r, uint32_t n, int64_t *o)
{
    int64_t base = ins->src[0].v.imm_i, rs = ins->src[1].v.imm_i, cs = ins->src[2].v.imm_i;
    for (uint32_t c = 0; c < n; c++)
        o[c] = wrap_add(base, wrap_add(wrap_mul(r, rs), wrap_mul(c, cs)));
}

/* ---- the table ------------------------------------------------------------------------ */

#define AUX_MAX_NONE 255u       /* aux is ignored */
#define AUX_MAX_FORM 255u       /* GELU: 0 is the erf form, anything else the tanh form */
#define AUX_MAX_CMP SPY_CMP_GE

enum { /* the ops' positions in the table */
#define POSITION(NAME, ...) AT_##NAME,
    SPY_SFU_OPS(POSITION)
#undef POSITION
    NUM_OPS
};

static const spy_sfu_op table[NUM_OPS] = {
#define DESCRIBE(NAME, opcode, arity, aux, cost, kind, f, i)                                       \
    [AT_##NAME] = {#NAME, opcode, arity, AUX_MAX_##aux, SPY_SFU_COST_##cost, SPY_SFU_KIND_##kind, 0},
    SPY_SFU_OPS(DESCRIBE)
#undef DESCRIBE
};

const spy_sfu_op *spy_sfu_op_find(uint32_t opcode)
{
    switch (opcode) {
#define FIND(NAME, opcode, ...)                                                                    \
    case opcode: return &table[AT_##NAME];
        SPY_SFU_OPS(FIND)
#undef FIND
    }
    return NULL;
}

spy_status spy_sfu_ops(const spy_sfu_op **ops, uint32_t *n)
{
    if (!ops || !n)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null output");
    *ops = table;
    *n = NUM_OPS;
    return SPY_OK;
}

/* ---- running an instruction ------------------------------------------------------------- */

/* Compute row r of ins in the float (fl) or integer domain: the op's implementation for
 * its kind, on the staged rows (sources in [0..2], results in [3]); a reduction stores
 * its value at dst itself. */
static void compute_row(const spy_instr *ins, bool fl, spy_sfu_rows *rb, uint32_t r, uint32_t n,
                        uint8_t *dst)
{
#define RUN_MAP(F, I)                                                                              \
    if (fl)                                                                                        \
        F(ins, n, rb->f[3], rb->f[0], rb->f[1], rb->f[2]);                                         \
    else                                                                                           \
        I(ins, n, rb->i[3], rb->i[0], rb->i[1], rb->i[2])
#define RUN_CAST RUN_MAP
#define RUN_TEST(F, I)                                                                             \
    if (fl)                                                                                        \
        F(ins, n, rb->i[3], rb->f[0], rb->f[1]);                                                   \
    else                                                                                           \
        I(ins, n, rb->i[3], rb->i[0], rb->i[1])
#define RUN_REDUCE(F, I)                                                                           \
    if (fl)                                                                                        \
        F(ins, n, rb->f[0], dst);                                                                  \
    else                                                                                           \
        I(ins, n, rb->i[0], dst)
#define RUN_IOTA(F, I)                                                                             \
    if (fl)                                                                                        \
        F(ins, r, n, rb->f[3]);                                                                    \
    else                                                                                           \
        I(ins, r, n, rb->i[3])
#define CASE(NAME, opcode, arity, aux, cost, kind, F, I)                                           \
    case opcode: RUN_##kind(F, I); return;
    switch (ins->op) {
        SPY_SFU_OPS(CASE)
    }
#undef CASE
#undef RUN_MAP
#undef RUN_CAST
#undef RUN_TEST
#undef RUN_REDUCE
#undef RUN_IOTA
}

/* Whether an instruction computes in the float domain (the kinds of sfu_ops.h). */
static bool float_domain(const spy_sfu_op *op, const spy_instr *ins)
{
    switch (op->kind) {
    case SPY_SFU_KIND_TEST:
        for (uint32_t k = 0; k < op->arity; k++)
            if (is_float(ins->src[k].dtype))
                return true;
        return false;
    case SPY_SFU_KIND_REDUCE:
        return is_float(ins->src[0].dtype);
    default:
        return is_float(ins->dst.dtype);
    }
}

spy_status spy_sfu_run(const spy_instr *ins, uint8_t *lx, spy_sfu_rows *rb)
{
    const spy_sfu_op *op = spy_sfu_op_find(ins->op); /* validated: in the table */
    uint32_t n = ins->cols;
    if (!op)
        return SPY_E_BAD_COMMAND;
    if (!ensure(rb, n))
        return SPY_E_HOST_NOMEM;
    bool fl = float_domain(op, ins);
    /* CAST of a float source into an integer destination: stage as float, convert. */
    bool convert = op->kind == SPY_SFU_KIND_CAST && !fl && is_float(ins->src[0].dtype);
    uint32_t staged = op->kind == SPY_SFU_KIND_IOTA ? 0 : op->arity;
    for (uint32_t r = 0; r < ins->rows; r++) {
        for (uint32_t k = 0; k < staged; k++) {
            if (fl || convert)
                stage_f(lx, &ins->src[k], r, n, rb->f[k]);
            else
                stage_i(lx, &ins->src[k], r, n, rb->i[k]);
        }
        if (convert) {
            bool to_bool = ins->dst.dtype == SPY_DT_BOOL;
            for (uint32_t c = 0; c < n; c++)
                rb->i[3][c] = to_bool ? rb->f[0][c] != 0 : f2i(rb->f[0][c]);
            write_i(lx, ins, r, n, rb->i[3]);
            continue;
        }
        compute_row(ins, fl, rb, r, n, at(lx, &ins->dst, r, 0));
        if (op->kind == SPY_SFU_KIND_REDUCE)
            continue;
        if (fl && op->kind != SPY_SFU_KIND_TEST)
            write_f(lx, ins, r, n, rb->f[3]);
        else
            write_i(lx, ins, r, n, rb->i[3]);
    }
    return SPY_OK;
}

/* Whether an instruction runs at the fp32 rate: its destination or a source it reads is an
 * fp32 operand in the scratchpad. A mixed instruction runs at the rate of its widest
 * element; an immediate is one constant, not a stream of elements, and sources past the
 * op's arity are unused (a zeroed one would read as SPY_DT_F32). */
static bool runs_fp32(const spy_sfu_op *op, const spy_instr *ins)
{
    if (ins->dst.dtype == SPY_DT_F32)
        return true;
    uint32_t reads = op && op->kind != SPY_SFU_KIND_IOTA ? op->arity : 0;
    for (uint32_t k = 0; k < reads; k++)
        if (ins->src[k].kind != SPY_OPND_IMM && ins->src[k].dtype == SPY_DT_F32)
            return true;
    return false;
}

double spy_sfu_cycles(const spy_profile *p, const spy_instr *ins)
{
    const spy_sfu_op *op = spy_sfu_op_find(ins->op);
    double elems = (double)ins->rows * ins->cols;
    double per = op && op->cost == SPY_SFU_COST_TRANSCENDENTAL ? p->sfu_transcendental_cycles : 1.0;
    double rate = p->sfu_elems_per_cycle * (runs_fp32(op, ins) ? p->sfu_fp32_ratio : 1.0);
    return elems * per / rate;
}
