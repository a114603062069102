/* sfu_ops.h -- the SFU op table: every instruction the special-function units run,
 * declared once. Part of spyre.h (which includes it).
 *
 * From this list come the SPY_SFU_* opcodes (spyre.h), the validator's checks of an
 * instruction (program.c: arity, destination shape, aux), the units' execution and cost
 * (sfu.c) and the table the Python layer reads (spy_sfu_ops): adding an op is a row here
 * and its two implementations in sfu.c. Opcodes are part of the program block format
 * (plans on disk hold them): never renumber a row.
 *
 * X(NAME, opcode, arity, aux, cost, kind, float implementation, integer implementation)
 *   arity   source operands it reads (the others must be SPY_OPND_NONE)
 *   aux     what the instruction's aux byte holds: NONE (ignored), CMP (a SPY_CMP_* code,
 *           checked), FORM (GELU: 0 the erf form, otherwise the tanh form)
 *   cost    SIMPLE (one pass per element) or TRANSCENDENTAL (the profile's
 *           sfu_transcendental_cycles per element); either at sfu_fp32_ratio of the
 *           rate when an operand in the scratchpad is fp32 (spy_sfu_cycles)
 *   kind    how sfu.c runs it; "domain" is whether arithmetic is fp32 (float) or int64:
 *           MAP     elementwise; the destination's dtype picks the domain
 *           CAST    MAP, except that a float source into an integer destination
 *                   converts (truncates; non-zero is true for BOOL)
 *           TEST    elementwise predicate with a boolean result; float domain when any
 *                   source is float
 *           REDUCE  over the columns of each row into a ROW (or SCALAR) destination; the
 *                   source's dtype picks the domain
 *           IOTA    dst[r, c] = imm0 + r * imm1 + c * imm2; the destination's dtype picks
 *                   the domain, every source is an immediate
 *   implementations: the functions of sfu.c that compute a row in each domain; their
 *           signature is the kind's (sfu.c). f_zero / i_zero: the op has no meaning in that
 *           domain and writes zeros. */
#ifndef SPYRE_SFU_OPS_H
#define SPYRE_SFU_OPS_H

/* clang-format off */
#define SPY_SFU_OPS(X)                                                                      \
    X(MOV,        0, 1, NONE, SIMPLE,         CAST,   f_mov,       i_mov)                   \
    X(ADD,        1, 2, NONE, SIMPLE,         MAP,    f_add,       i_add)                   \
    X(SUB,        2, 2, NONE, SIMPLE,         MAP,    f_sub,       i_sub)                   \
    X(MUL,        3, 2, NONE, SIMPLE,         MAP,    f_mul,       i_mul)                   \
    X(DIV,        4, 2, NONE, TRANSCENDENTAL, MAP,    f_div,       i_div)      /* ints: toward zero */ \
    X(MAX,        5, 2, NONE, SIMPLE,         MAP,    f_max,       i_max)                   \
    X(MIN,        6, 2, NONE, SIMPLE,         MAP,    f_min,       i_min)                   \
    X(NEG,        7, 1, NONE, SIMPLE,         MAP,    f_neg,       i_neg)                   \
    X(ABS,        8, 1, NONE, SIMPLE,         MAP,    f_abs,       i_abs)                   \
    X(EXP,        9, 1, NONE, TRANSCENDENTAL, MAP,    f_exp,       i_zero)                  \
    X(LOG,       10, 1, NONE, TRANSCENDENTAL, MAP,    f_log,       i_zero)                  \
    X(SQRT,      11, 1, NONE, TRANSCENDENTAL, MAP,    f_sqrt,      i_zero)                  \
    X(RSQRT,     12, 1, NONE, TRANSCENDENTAL, MAP,    f_rsqrt,     i_zero)                  \
    X(TANH,      13, 1, NONE, TRANSCENDENTAL, MAP,    f_tanh,      i_zero)                  \
    X(SIGMOID,   14, 1, NONE, TRANSCENDENTAL, MAP,    f_sigmoid,   i_zero)                  \
    X(SILU,      15, 1, NONE, TRANSCENDENTAL, MAP,    f_silu,      i_zero)                  \
    X(GELU,      16, 1, FORM, TRANSCENDENTAL, MAP,    f_gelu,      i_zero)                  \
    X(POW,       17, 2, NONE, TRANSCENDENTAL, MAP,    f_pow,       i_pow)                   \
    X(CMP,       18, 2, CMP,  SIMPLE,         TEST,   f_cmp,       i_cmp)                   \
    X(SELECT,    19, 3, NONE, SIMPLE,         MAP,    f_select,    i_select)  /* src0 ? src1 : src2 */ \
    X(SIN,       20, 1, NONE, TRANSCENDENTAL, MAP,    f_sin,       i_zero)                  \
    X(COS,       21, 1, NONE, TRANSCENDENTAL, MAP,    f_cos,       i_zero)                  \
    X(RECIP,     22, 1, NONE, TRANSCENDENTAL, MAP,    f_recip,     i_zero)                  \
    X(FLOORDIV,  23, 2, NONE, TRANSCENDENTAL, MAP,    f_floordiv,  i_floordiv)              \
    X(MOD,       24, 2, NONE, TRANSCENDENTAL, MAP,    f_mod,       i_mod)      /* C fmod: sign of the dividend */ \
    X(AND,       25, 2, NONE, SIMPLE,         MAP,    f_zero,      i_and)      /* logical for BOOL, bitwise for ints */ \
    X(OR,        26, 2, NONE, SIMPLE,         MAP,    f_zero,      i_or)                    \
    X(NOT,       27, 1, NONE, SIMPLE,         MAP,    f_zero,      i_not)                   \
    X(ERF,       28, 1, NONE, TRANSCENDENTAL, MAP,    f_erf,       i_zero)                  \
    X(FLOOR,     29, 1, NONE, SIMPLE,         MAP,    f_floor,     i_mov)                   \
    X(CEIL,      30, 1, NONE, SIMPLE,         MAP,    f_ceil,      i_mov)                   \
    X(TRUNC,     31, 1, NONE, SIMPLE,         MAP,    f_trunc,     i_mov)                   \
    X(ROUND,     32, 1, NONE, SIMPLE,         MAP,    f_round,     i_mov)      /* half to even */ \
    X(SIGN,      33, 1, NONE, SIMPLE,         MAP,    f_sign,      i_sign)                  \
    X(LOG1P,     34, 1, NONE, TRANSCENDENTAL, MAP,    f_log1p,     i_zero)                  \
    X(EXPM1,     35, 1, NONE, TRANSCENDENTAL, MAP,    f_expm1,     i_zero)                  \
    X(IOTA,      36, 3, NONE, SIMPLE,         IOTA,   f_iota,      i_iota)                  \
    X(XOR,       37, 2, NONE, SIMPLE,         MAP,    f_zero,      i_xor)                   \
    X(ISNAN,     38, 1, NONE, SIMPLE,         TEST,   f_isnan,     i_isnan)                 \
    X(ATAN,      39, 1, NONE, TRANSCENDENTAL, MAP,    f_atan,      i_zero)                  \
    X(REMAINDER, 40, 2, NONE, TRANSCENDENTAL, MAP,    f_remainder, i_remainder) /* Python %: sign of the divisor */ \
    X(SIGNBIT,   41, 1, NONE, SIMPLE,         TEST,   f_signbit,   i_signbit) /* the sign bit: true for -0.0 */ \
    X(RSUM,      64, 1, NONE, SIMPLE,         REDUCE, f_rsum,      i_rsum)                  \
    X(RMAX,      65, 1, NONE, SIMPLE,         REDUCE, f_rmax,      i_rmax)                  \
    X(RMIN,      66, 1, NONE, SIMPLE,         REDUCE, f_rmin,      i_rmin)                  \
    X(RPROD,     67, 1, NONE, SIMPLE,         REDUCE, f_rprod,     i_rprod)                 \
    X(RARGMAX,   68, 1, NONE, SIMPLE,         REDUCE, f_rargmax,   i_rargmax)  /* first index of the maximum */ \
    X(RARGMIN,   69, 1, NONE, SIMPLE,         REDUCE, f_rargmin,   i_rargmin)               \
    X(RANY,      70, 1, NONE, SIMPLE,         REDUCE, f_rany,      i_rany)                  \
    X(RALL,      71, 1, NONE, SIMPLE,         REDUCE, f_rall,      i_rall)
/* clang-format on */

#endif
