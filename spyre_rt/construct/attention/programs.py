"""The SFU programs of an attention: one block of keys, a task's finish, a split task's combine."""

from __future__ import annotations

import numpy as np

from ...native import lib
from ..context import BuildContext
from ..sfu import COL, ROW, SCALAR, TILE, Operand, Program
from .scratchpad import Scratchpad
from .shape import Shape

TINY = float(np.finfo(np.float32).tiny)  # a row that saw no key has l = 0 and O = 0: out 0, as torch's CPU kernel
F32 = "float32"
NEG_INF = float("-inf")


def _tile(off: int, pitch: int, dtype: str = F32) -> Operand:
    return Operand(TILE, dtype, off, pitch)


def _row(off: int, dtype: str = F32) -> Operand:
    return Operand(ROW, dtype, off, 1)


def _imm(value: float, dtype: str = F32) -> Operand:
    return Operand(SCALAR, dtype, imm=value)


class Programs:
    """The SFU programs of one attention, each made once and shared by every block of its
    kind (the scratchpad offsets are the same on every core)."""

    def __init__(self, ctx: BuildContext, shape: Shape, lx: Scratchpad, scale: float):
        self.ctx, self.shape, self.lx, self.scale = ctx, shape, lx, scale
        self.made: dict[tuple, tuple[int, int]] = {}

    def get(self, key: tuple) -> tuple[int, int]:
        """(first instruction, count) of the program `key` names (see :meth:`make`)."""
        hit = self.made.get(key)
        if hit is None:
            prog = self.make(*key)
            hit = self.made[key] = (self.ctx.program.add_instrs(prog.array()), len(prog))
        return hit

    def make(self, kind: str, rows: int, *args) -> Program:
        """``("block", rows, slot, keys, first, diagonal)``: one block of keys;
        ``("finish", rows)``: a task's output; ``("combine", rows, parts)``: a split
        task's output from the states of its parts."""
        prog = Program()
        if kind == "block":
            self._block(prog, rows, *args)
            return prog
        if kind == "combine":
            self._combine(prog, rows, *args)
        self._finish(prog, rows)
        return prog

    def _block(self, prog: Program, rows: int, slot: int, keys: int, first: bool, diagonal: int | None) -> None:
        """One block of S: scale, mask, online softmax, P; O rescaled for its next P V."""
        s, lx = self.shape, self.lx
        r = s.group * rows
        S = _tile(lx.s[slot], lx.s_pitch)
        prog.emit(lib.SPY_SFU_MUL, r, keys, S, S, _imm(self.scale))
        if s.mask:
            self._mask(prog, rows, slot, keys, S)
        if diagonal is not None:
            self._diagonal(prog, rows, keys, S, diagonal)
        top, total, t = _row(lx.m), _row(lx.l), _row(lx.t)
        if first:
            prog.emit(lib.SPY_SFU_RMAX, r, keys, top, S)
            safe = self._safe(prog, r, top)
        else:
            mn, alpha = _row(lx.mn), _row(lx.alpha)
            prog.emit(lib.SPY_SFU_RMAX, r, keys, t, S)
            prog.emit(lib.SPY_SFU_MAX, r, 1, mn, top, t)
            safe = self._safe(prog, r, mn)
            prog.emit(lib.SPY_SFU_SUB, r, 1, alpha, top, safe)  # exp(m - m'): how far the old max fell behind
            prog.emit(lib.SPY_SFU_EXP, r, 1, alpha, alpha)
            prog.emit(lib.SPY_SFU_MOV, r, 1, top, mn)
        prog.emit(lib.SPY_SFU_SUB, r, keys, S, S, safe)
        prog.emit(lib.SPY_SFU_EXP, r, keys, S, S)
        prog.emit(lib.SPY_SFU_RSUM, r, keys, total if first else t, S)
        if not first:
            prog.emit(lib.SPY_SFU_MUL, r, 1, total, total, alpha)
            prog.emit(lib.SPY_SFU_ADD, r, 1, total, total, t)
            acc = _tile(lx.o, lx.o_pitch)
            prog.emit(lib.SPY_SFU_MUL, r, s.v_dim, acc, acc, alpha)
        if lx.p is not None:  # the arrays take P in the operands' dtype; l summed it unrounded
            prog.emit(lib.SPY_SFU_MOV, r, keys, _tile(lx.p, lx.p_pitch, s.dtype), S)

    def _mask(self, prog: Program, rows: int, slot: int, keys: int, S: Operand) -> None:
        """The mask tile on S: one instruction when its rows line up with S's (a mask per
        head, or one query row), else one per head of the group."""
        s, lx = self.shape, self.lx
        if s.mask_heads == s.group:
            pairs = [(s.group * rows, S, _tile(lx.mask[slot], lx.m_pitch, s.mask_dtype))]
        elif rows == 1:
            pairs = [(s.group, S, Operand(COL, s.mask_dtype, lx.mask[slot]))]
        else:
            head = rows * lx.s_pitch * 4
            pairs = [(rows, S.at(S.off + g * head), _tile(lx.mask[slot], lx.m_pitch, s.mask_dtype))
                     for g in range(s.group)]
        for r, dst, mask in pairs:
            if s.mask == "bool":
                prog.emit(lib.SPY_SFU_SELECT, r, keys, dst, mask, dst, _imm(NEG_INF))
            else:
                prog.emit(lib.SPY_SFU_ADD, r, keys, dst, dst, mask)

    def _diagonal(self, prog: Program, rows: int, keys: int, S: Operand, start: int) -> None:
        """Keys past the causal diagonal of each row: key kv0 + j for query q0 + i when
        ``start + j - i > 0``, with start = kv0 - q0 - q_offset."""
        s, lx = self.shape, self.lx
        d = _tile(lx.diag, lx.s_pitch)
        past = _tile(lx.diag_flag, lx.flag_pitch, "bool")
        prog.emit(lib.SPY_SFU_IOTA, rows, keys, d, _imm(float(start)), _imm(-1.0), _imm(1.0))
        prog.emit(lib.SPY_SFU_CMP, rows, keys, past, d, _imm(0.0), aux=lib.SPY_CMP_GT)
        head = rows * lx.s_pitch * 4
        for g in range(s.group):
            dst = S.at(S.off + g * head)
            prog.emit(lib.SPY_SFU_SELECT, rows, keys, dst, past, _imm(NEG_INF), dst)

    def _safe(self, prog: Program, r: int, m: Operand) -> Operand:
        """The max to subtract: 0 where a row has seen no key yet (its max is -inf, and
        -inf - -inf would make its exponentials NaN instead of 0)."""
        if not self.shape.guarded:
            return m
        lx = self.lx
        none, safe = _row(lx.flag, "bool"), _row(lx.safe)
        prog.emit(lib.SPY_SFU_CMP, r, 1, none, m, _imm(NEG_INF), aux=lib.SPY_CMP_EQ)
        prog.emit(lib.SPY_SFU_SELECT, r, 1, safe, none, _imm(0.0), m)
        return safe

    def _combine(self, prog: Program, rows: int, parts: int) -> None:
        """The states of a split task's parts folded into the first part's, each scaled by
        exp(its max - the overall max)."""
        s, lx = self.shape, self.lx
        r, dv, rb = s.group * rows, s.v_dim, lx.row_bytes
        states = [lx.state_of(p) for p in range(parts)]
        mn, alpha, t = _row(lx.mn), _row(lx.alpha), _row(lx.t)
        prog.emit(lib.SPY_SFU_MOV, r, 1, mn, _row(states[0]))
        for st in states[1:]:
            prog.emit(lib.SPY_SFU_MAX, r, 1, mn, mn, _row(st))
        safe = self._safe(prog, r, mn)
        l0, o0 = _row(states[0] + rb), _tile(states[0] + 2 * rb, lx.o_pitch)
        for k, st in enumerate(states):
            prog.emit(lib.SPY_SFU_SUB, r, 1, alpha, _row(st), safe)
            prog.emit(lib.SPY_SFU_EXP, r, 1, alpha, alpha)
            if k == 0:
                prog.emit(lib.SPY_SFU_MUL, r, 1, l0, l0, alpha)
                prog.emit(lib.SPY_SFU_MUL, r, dv, o0, o0, alpha)
                continue
            o = _tile(st + 2 * rb, lx.o_pitch)
            prog.emit(lib.SPY_SFU_MUL, r, 1, t, _row(st + rb), alpha)
            prog.emit(lib.SPY_SFU_ADD, r, 1, l0, l0, t)
            prog.emit(lib.SPY_SFU_MUL, r, dv, o, o, alpha)
            prog.emit(lib.SPY_SFU_ADD, r, dv, o0, o0, o)

    def _finish(self, prog: Program, rows: int) -> None:
        """O / l, rounded into the staging tile that is stored."""
        s, lx = self.shape, self.lx
        r, t = s.group * rows, _row(lx.t)
        prog.emit(lib.SPY_SFU_MAX, r, 1, t, _row(lx.l), _imm(TINY))
        prog.emit(lib.SPY_SFU_RECIP, r, 1, t, t)
        prog.emit(lib.SPY_SFU_MUL, r, s.v_dim, _tile(lx.stage, lx.stage_pitch, s.dtype), _tile(lx.o, lx.o_pitch), t)

