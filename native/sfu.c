/* sfu.c -- the special-function units: elementwise and row-reduction instructions.
 *
 * An instruction covers rows x cols elements. Each row is staged into fp32 (float
 * destinations and float reductions) or int64 (integer and boolean work) scratch rows,
 * computed with one tight loop per opcode, and written back rounded to the destination
 * dtype. Integer arithmetic wraps (two's complement) instead of overflowing, and integer
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

static float gelu(float x, int tanh_form)
{
    if (tanh_form)
        return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
}

static void float_op(const spy_instr *ins, uint32_t n, float *o, const float *a, const float *b,
                     const float *c)
{
    switch (ins->op) {
    case SPY_SFU_MOV: for (uint32_t i = 0; i < n; i++) o[i] = a[i]; break;
    case SPY_SFU_ADD: for (uint32_t i = 0; i < n; i++) o[i] = a[i] + b[i]; break;
    case SPY_SFU_SUB: for (uint32_t i = 0; i < n; i++) o[i] = a[i] - b[i]; break;
    case SPY_SFU_MUL: for (uint32_t i = 0; i < n; i++) o[i] = a[i] * b[i]; break;
    case SPY_SFU_DIV: for (uint32_t i = 0; i < n; i++) o[i] = a[i] / b[i]; break;
    case SPY_SFU_MAX:
        for (uint32_t i = 0; i < n; i++) o[i] = isnan(a[i]) || a[i] > b[i] ? a[i] : b[i];
        break;
    case SPY_SFU_MIN:
        for (uint32_t i = 0; i < n; i++) o[i] = isnan(a[i]) || a[i] < b[i] ? a[i] : b[i];
        break;
    case SPY_SFU_NEG: for (uint32_t i = 0; i < n; i++) o[i] = -a[i]; break;
    case SPY_SFU_ABS: for (uint32_t i = 0; i < n; i++) o[i] = fabsf(a[i]); break;
    case SPY_SFU_EXP: for (uint32_t i = 0; i < n; i++) o[i] = expf(a[i]); break;
    case SPY_SFU_LOG: for (uint32_t i = 0; i < n; i++) o[i] = logf(a[i]); break;
    case SPY_SFU_SQRT: for (uint32_t i = 0; i < n; i++) o[i] = sqrtf(a[i]); break;
    case SPY_SFU_RSQRT: for (uint32_t i = 0; i < n; i++) o[i] = 1.0f / sqrtf(a[i]); break;
    case SPY_SFU_TANH: for (uint32_t i = 0; i < n; i++) o[i] = tanhf(a[i]); break;
    case SPY_SFU_SIGMOID: for (uint32_t i = 0; i < n; i++) o[i] = 1.0f / (1.0f + expf(-a[i])); break;
    case SPY_SFU_SILU: for (uint32_t i = 0; i < n; i++) o[i] = a[i] / (1.0f + expf(-a[i])); break;
    case SPY_SFU_GELU: for (uint32_t i = 0; i < n; i++) o[i] = gelu(a[i], ins->aux); break;
    case SPY_SFU_POW: for (uint32_t i = 0; i < n; i++) o[i] = powf(a[i], b[i]); break;
    case SPY_SFU_SIN: for (uint32_t i = 0; i < n; i++) o[i] = sinf(a[i]); break;
    case SPY_SFU_COS: for (uint32_t i = 0; i < n; i++) o[i] = cosf(a[i]); break;
    case SPY_SFU_RECIP: for (uint32_t i = 0; i < n; i++) o[i] = 1.0f / a[i]; break;
    case SPY_SFU_FLOORDIV: for (uint32_t i = 0; i < n; i++) o[i] = floorf(a[i] / b[i]); break;
    case SPY_SFU_MOD: for (uint32_t i = 0; i < n; i++) o[i] = fmodf(a[i], b[i]); break;
    case SPY_SFU_REMAINDER:
        for (uint32_t i = 0; i < n; i++) {
            float m = fmodf(a[i], b[i]);
            o[i] = (m != 0 && ((m < 0) != (b[i] < 0))) ? m + b[i] : m;
        }
        break;
    case SPY_SFU_ERF: for (uint32_t i = 0; i < n; i++) o[i] = erff(a[i]); break;
    case SPY_SFU_FLOOR: for (uint32_t i = 0; i < n; i++) o[i] = floorf(a[i]); break;
    case SPY_SFU_CEIL: for (uint32_t i = 0; i < n; i++) o[i] = ceilf(a[i]); break;
    case SPY_SFU_TRUNC: for (uint32_t i = 0; i < n; i++) o[i] = truncf(a[i]); break;
    case SPY_SFU_ROUND: for (uint32_t i = 0; i < n; i++) o[i] = nearbyintf(a[i]); break;
    case SPY_SFU_SIGN:
        for (uint32_t i = 0; i < n; i++) o[i] = (float)((a[i] > 0) - (a[i] < 0));
        break;
    case SPY_SFU_LOG1P: for (uint32_t i = 0; i < n; i++) o[i] = log1pf(a[i]); break;
    case SPY_SFU_EXPM1: for (uint32_t i = 0; i < n; i++) o[i] = expm1f(a[i]); break;
    case SPY_SFU_ATAN: for (uint32_t i = 0; i < n; i++) o[i] = atanf(a[i]); break;
    case SPY_SFU_SELECT: for (uint32_t i = 0; i < n; i++) o[i] = a[i] != 0 ? b[i] : c[i]; break;
    default: for (uint32_t i = 0; i < n; i++) o[i] = 0; break;
    }
}

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

static void int_op(const spy_instr *ins, uint32_t n, int64_t *o, const int64_t *a, const int64_t *b,
                   const int64_t *c)
{
    switch (ins->op) {
    case SPY_SFU_MOV: for (uint32_t i = 0; i < n; i++) o[i] = a[i]; break;
    case SPY_SFU_ADD: for (uint32_t i = 0; i < n; i++) o[i] = wrap_add(a[i], b[i]); break;
    case SPY_SFU_SUB: for (uint32_t i = 0; i < n; i++) o[i] = wrap_sub(a[i], b[i]); break;
    case SPY_SFU_MUL: for (uint32_t i = 0; i < n; i++) o[i] = wrap_mul(a[i], b[i]); break;
    case SPY_SFU_DIV: for (uint32_t i = 0; i < n; i++) o[i] = idiv_trunc(a[i], b[i]); break;
    case SPY_SFU_FLOORDIV: for (uint32_t i = 0; i < n; i++) o[i] = idiv_floor(a[i], b[i]); break;
    case SPY_SFU_MOD: for (uint32_t i = 0; i < n; i++) o[i] = imod_trunc(a[i], b[i]); break;
    case SPY_SFU_REMAINDER: for (uint32_t i = 0; i < n; i++) o[i] = imod_floor(a[i], b[i]); break;
    case SPY_SFU_MAX: for (uint32_t i = 0; i < n; i++) o[i] = a[i] > b[i] ? a[i] : b[i]; break;
    case SPY_SFU_MIN: for (uint32_t i = 0; i < n; i++) o[i] = a[i] < b[i] ? a[i] : b[i]; break;
    case SPY_SFU_NEG: for (uint32_t i = 0; i < n; i++) o[i] = wrap_sub(0, a[i]); break;
    case SPY_SFU_ABS: for (uint32_t i = 0; i < n; i++) o[i] = a[i] < 0 ? wrap_sub(0, a[i]) : a[i]; break;
    case SPY_SFU_POW: for (uint32_t i = 0; i < n; i++) o[i] = ipow(a[i], b[i]); break;
    case SPY_SFU_AND: for (uint32_t i = 0; i < n; i++) o[i] = a[i] & b[i]; break;
    case SPY_SFU_OR: for (uint32_t i = 0; i < n; i++) o[i] = a[i] | b[i]; break;
    case SPY_SFU_XOR: for (uint32_t i = 0; i < n; i++) o[i] = a[i] ^ b[i]; break;
    case SPY_SFU_NOT:
        if (ins->dst.dtype == SPY_DT_BOOL)
            for (uint32_t i = 0; i < n; i++) o[i] = a[i] == 0;
        else
            for (uint32_t i = 0; i < n; i++) o[i] = ~a[i];
        break;
    case SPY_SFU_SIGN: for (uint32_t i = 0; i < n; i++) o[i] = (a[i] > 0) - (a[i] < 0); break;
    case SPY_SFU_SELECT: for (uint32_t i = 0; i < n; i++) o[i] = a[i] != 0 ? b[i] : c[i]; break;
    case SPY_SFU_FLOOR: case SPY_SFU_CEIL: case SPY_SFU_TRUNC: case SPY_SFU_ROUND:
        for (uint32_t i = 0; i < n; i++) o[i] = a[i];
        break;
    default: for (uint32_t i = 0; i < n; i++) o[i] = 0; break;
    }
}

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

static void reduce_row(const spy_instr *ins, uint8_t *lx, uint32_t r, uint32_t n, spy_sfu_rows *rb)
{
    const spy_operand *s = &ins->src[0];
    bool fl = is_float(s->dtype) && ins->op != SPY_SFU_RANY && ins->op != SPY_SFU_RALL;
    uint8_t *dst = at(lx, &ins->dst, r, 0);
    if (fl) {
        float *a = rb->f[0];
        stage_f(lx, s, r, n, a);
        switch (ins->op) {
        case SPY_SFU_RSUM: case SPY_SFU_RPROD: {
            double acc = ins->op == SPY_SFU_RSUM ? 0.0 : 1.0;
            for (uint32_t i = 0; i < n; i++)
                acc = ins->op == SPY_SFU_RSUM ? acc + a[i] : acc * a[i];
            store_f(dst, ins->dst.dtype, (float)acc);
            return;
        }
        case SPY_SFU_RMAX: case SPY_SFU_RMIN: {
            float m = a[0];
            for (uint32_t i = 1; i < n && !isnan(m); i++)
                if (isnan(a[i]) || (ins->op == SPY_SFU_RMAX ? a[i] > m : a[i] < m))
                    m = a[i];
            store_f(dst, ins->dst.dtype, m);
            return;
        }
        default: { /* argmax / argmin: first extreme, NaN counts as the extreme */
            uint32_t best = 0;
            for (uint32_t i = 1; i < n && !isnan(a[best]); i++)
                if (isnan(a[i]) || (ins->op == SPY_SFU_RARGMAX ? a[i] > a[best] : a[i] < a[best]))
                    best = i;
            store_i(dst, ins->dst.dtype, best);
            return;
        }
        }
    }
    int64_t *a = rb->i[0];
    stage_i(lx, s, r, n, a);
    int64_t acc;
    switch (ins->op) {
    case SPY_SFU_RSUM: acc = 0; for (uint32_t i = 0; i < n; i++) acc = wrap_add(acc, a[i]); break;
    case SPY_SFU_RPROD: acc = 1; for (uint32_t i = 0; i < n; i++) acc = wrap_mul(acc, a[i]); break;
    case SPY_SFU_RMAX: acc = a[0]; for (uint32_t i = 1; i < n; i++) if (a[i] > acc) acc = a[i]; break;
    case SPY_SFU_RMIN: acc = a[0]; for (uint32_t i = 1; i < n; i++) if (a[i] < acc) acc = a[i]; break;
    case SPY_SFU_RANY: acc = 0; for (uint32_t i = 0; i < n; i++) acc |= a[i] != 0; break;
    case SPY_SFU_RALL: acc = 1; for (uint32_t i = 0; i < n; i++) acc &= a[i] != 0; break;
    default: {
        uint32_t best = 0;
        for (uint32_t i = 1; i < n; i++)
            if (ins->op == SPY_SFU_RARGMAX ? a[i] > a[best] : a[i] < a[best])
                best = i;
        acc = best;
    }
    }
    store_i(dst, ins->dst.dtype, acc);
}

spy_status spy_sfu_run(const spy_instr *ins, uint8_t *lx, spy_sfu_rows *rb)
{
    uint32_t n = ins->cols;
    if (!ensure(rb, n))
        return SPY_E_HOST_NOMEM;
    if (ins->op >= SPY_SFU_RSUM) {
        for (uint32_t r = 0; r < ins->rows; r++)
            reduce_row(ins, lx, r, n, rb);
        return SPY_OK;
    }
    uint32_t dt = ins->dst.dtype;
    if (ins->op == SPY_SFU_IOTA) {
        for (uint32_t r = 0; r < ins->rows; r++) {
            if (is_float(dt)) {
                double b = ins->src[0].v.imm_f, rs = ins->src[1].v.imm_f, cs = ins->src[2].v.imm_f;
                for (uint32_t c = 0; c < n; c++)
                    rb->f[0][c] = (float)(b + r * rs + c * cs);
                write_f(lx, ins, r, n, rb->f[0]);
            } else {
                int64_t b = ins->src[0].v.imm_i, rs = ins->src[1].v.imm_i, cs = ins->src[2].v.imm_i;
                for (uint32_t c = 0; c < n; c++)
                    rb->i[0][c] = wrap_add(b, wrap_add(wrap_mul(r, rs), wrap_mul(c, cs)));
                write_i(lx, ins, r, n, rb->i[0]);
            }
        }
        return SPY_OK;
    }
    if (ins->op == SPY_SFU_CMP || ins->op == SPY_SFU_ISNAN) {
        bool fl = is_float(ins->src[0].dtype) ||
                  (ins->op == SPY_SFU_CMP && is_float(ins->src[1].dtype));
        for (uint32_t r = 0; r < ins->rows; r++) {
            int64_t *o = rb->i[3];
            if (ins->op == SPY_SFU_ISNAN) {
                stage_f(lx, &ins->src[0], r, n, rb->f[0]);
                for (uint32_t c = 0; c < n; c++)
                    o[c] = isnan(rb->f[0][c]);
            } else if (fl) {
                stage_f(lx, &ins->src[0], r, n, rb->f[0]);
                stage_f(lx, &ins->src[1], r, n, rb->f[1]);
                for (uint32_t c = 0; c < n; c++)
                    o[c] = cmp_f(ins->aux, rb->f[0][c], rb->f[1][c]);
            } else {
                stage_i(lx, &ins->src[0], r, n, rb->i[0]);
                stage_i(lx, &ins->src[1], r, n, rb->i[1]);
                for (uint32_t c = 0; c < n; c++)
                    o[c] = cmp_i(ins->aux, rb->i[0][c], rb->i[1][c]);
            }
            write_i(lx, ins, r, n, o);
        }
        return SPY_OK;
    }
    /* A float source converted to an integer destination truncates (a cast); otherwise
     * the destination's type decides where the arithmetic happens. */
    bool fl = is_float(dt);
    if (ins->op == SPY_SFU_MOV && !fl && is_float(ins->src[0].dtype)) {
        for (uint32_t r = 0; r < ins->rows; r++) {
            stage_f(lx, &ins->src[0], r, n, rb->f[0]);
            for (uint32_t c = 0; c < n; c++)
                rb->i[3][c] = dt == SPY_DT_BOOL ? rb->f[0][c] != 0 : f2i(rb->f[0][c]);
            write_i(lx, ins, r, n, rb->i[3]);
        }
        return SPY_OK;
    }
    int arity = ins->op == SPY_SFU_SELECT ? 3 : (ins->src[1].kind != SPY_OPND_NONE ? 2 : 1);
    for (uint32_t r = 0; r < ins->rows; r++) {
        if (fl) {
            for (int k = 0; k < arity; k++)
                stage_f(lx, &ins->src[k], r, n, rb->f[k]);
            float_op(ins, n, rb->f[3], rb->f[0], rb->f[1], rb->f[2]);
            write_f(lx, ins, r, n, rb->f[3]);
        } else {
            for (int k = 0; k < arity; k++)
                stage_i(lx, &ins->src[k], r, n, rb->i[k]);
            int_op(ins, n, rb->i[3], rb->i[0], rb->i[1], rb->i[2]);
            write_i(lx, ins, r, n, rb->i[3]);
        }
    }
    return SPY_OK;
}

static bool transcendental(uint32_t op)
{
    switch (op) {
    case SPY_SFU_EXP: case SPY_SFU_LOG: case SPY_SFU_SQRT: case SPY_SFU_RSQRT: case SPY_SFU_TANH:
    case SPY_SFU_SIGMOID: case SPY_SFU_SILU: case SPY_SFU_GELU: case SPY_SFU_POW: case SPY_SFU_SIN:
    case SPY_SFU_COS: case SPY_SFU_DIV: case SPY_SFU_RECIP: case SPY_SFU_ERF: case SPY_SFU_LOG1P:
    case SPY_SFU_EXPM1: case SPY_SFU_ATAN: case SPY_SFU_FLOORDIV: case SPY_SFU_MOD:
    case SPY_SFU_REMAINDER:
        return true;
    default:
        return false;
    }
}

double spy_sfu_cycles(const spy_profile *p, const spy_instr *ins)
{
    double elems = (double)ins->rows * ins->cols;
    double per = transcendental(ins->op) ? p->sfu_transcendental_cycles : 1.0;
    return elems * per / p->sfu_elems_per_cycle;
}
