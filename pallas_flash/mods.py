"""Programmable attention: `score_mod` and `mask_mod`, and the built-in mods written with them.

A score_mod is a plain JAX function of scalars, `score_mod(score, batch, head, q_idx, kv_idx) -> score`, and a
mask_mod `mask_mod(batch, head, q_idx, kv_idx) -> bool` (True = attend), as in PyTorch's flex attention. `score`
is the float32 logit after the scale (and after `logits_soft_cap`, `bias` and `alibi_slopes` where given); the
indices are int32 (query head, positions from each sequence's start). They may close over arrays (document ids,
a bias table, per-head slopes): those travel as arguments of the compiled call, so new values do not recompile,
and float ones get gradients.

Each function is traced once to a jaxpr (`Program`). The XLA paths evaluate it with `jax.vmap`, gathers and
all. The kernels evaluate it on tiles: `stage` splits it into what depends on the query position alone (with
batch and head), computed for every query in XLA and read by the kernels as row vectors; what depends on the
key position alone, read as column vectors; and the joint rest, which must be elementwise (no indexing of a
closed-over array by both positions), evaluated on each [block_q, block_kv] tile of logits.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import operator
import typing

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_flash import masks

SCORE, BATCH, HEAD, QUERY, KEY = "score", "batch", "head", "query", "key"
_INDEX_NAMES = (BATCH, HEAD, QUERY, KEY)


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A traced score_mod or mask_mod. Hashable by its printed jaxpr (structure, literals and the shapes of what
    it closes over, not their values), so it can be a static argument: new closed-over values reuse the compile.

    jaxpr: inputs are the closed-over arrays, then (score,) batch, head, q_idx, kv_idx, all scalars."""

    kind: str  # "score" or "mask"
    jaxpr: typing.Any = dataclasses.field(repr=False)
    num_consts: int
    key: str = dataclasses.field(repr=False)

    def __repr__(self):
        return f"Program({self.kind}, {len(self.jaxpr.eqns)} equations, {self.num_consts} closed-over arrays)"

    def __hash__(self):
        return hash((self.kind, self.key))

    def __eq__(self, other):
        return isinstance(other, Program) and (self.kind, self.key) == (other.kind, other.key)

    @property
    def argnames(self):
        return ((SCORE,) if self.kind == "score" else ()) + _INDEX_NAMES

    def __call__(self, consts, *args):
        """Evaluate on scalars (`consts`: the closed-over arrays, in order)."""
        return jex.jaxpr_as_fun(jex.ClosedJaxpr(self.jaxpr, ()))(*consts, *args)[0]

    def apply(self, consts, *args):
        """Evaluate elementwise over broadcasting arrays (score float32, indices int32): vmapped, so a mod
        written for scalars (with gathers) gives the broadcast shape of its arguments."""
        args = [jnp.asarray(a, jnp.float32 if name == SCORE else jnp.int32) for a, name in zip(args, self.argnames)]
        shape = jnp.broadcast_shapes(*(a.shape for a in args))
        flat = [jnp.broadcast_to(a, shape).reshape(-1) for a in args]
        return jax.vmap(lambda *xs: self(consts, *xs))(*flat).reshape(shape)


def _signature_error(name: str, fn, count: int):
    want = "(score, batch, head, q_idx, kv_idx)" if count == 5 else "(batch, head, q_idx, kv_idx)"
    return TypeError(f"{name} must be a function {want} of scalars, got {fn!r}")


def trace(fn, kind: str, name: str | None = None):
    """`fn` as (Program, closed-over arrays). TypeError naming the argument for a wrong signature or a result
    that is not one scalar (float for a score_mod, bool for a mask_mod)."""
    name = name or f"{kind}_mod"
    count = 5 if kind == "score" else 4
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError:
        raise _signature_error(name, fn, count) from None
    except ValueError:  # builtins without a signature: tracing will tell
        pass
    index = jax.ShapeDtypeStruct((), jnp.int32)
    args = ((jax.ShapeDtypeStruct((), jnp.float32),) if kind == "score" else ()) + (index,) * 4
    try:
        closed = jax.make_jaxpr(fn)(*args)
    except TypeError as e:
        raise TypeError(f"{name} failed on scalar arguments: {e}") from e
    outs = closed.out_avals
    if len(outs) != 1 or outs[0].shape != ():
        got = ", ".join(str(a) for a in outs)
        raise TypeError(f"{name} must return one scalar, got {got}")
    dtype = outs[0].dtype
    if kind == "score" and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must return a float scalar, got {dtype}")
    if kind == "mask" and dtype != jnp.bool_:
        raise TypeError(f"{name} must return a bool scalar (True = attend), got {dtype}")
    jaxpr = closed.jaxpr
    # Closed-over arrays become the leading inputs, so their values are arguments, not constants.
    jaxpr = jaxpr.replace(invars=[*jaxpr.constvars, *jaxpr.invars], constvars=[])
    if kind == "score" and dtype != jnp.float32:
        jaxpr = _cast_output(jaxpr, jnp.float32)
    consts = tuple(jnp.asarray(c) for c in closed.consts)
    return Program(kind, jaxpr, len(consts), _key(jaxpr)), consts


def _key(jaxpr) -> str:
    return str(jaxpr)


def _cast_output(jaxpr, dtype):
    def cast(*args):
        return jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, ()))(*args)[0].astype(dtype)

    return jax.make_jaxpr(cast)(*(v.aval for v in jaxpr.invars)).jaxpr


# ---- Staging for the kernels ------------------------------------------------------------------------------

# Elementwise primitives the joint part may use (it runs on register tiles inside the kernels).
_ELEMENTWISE = {
    "add", "sub", "mul", "div", "rem", "neg", "max", "min", "abs", "sign", "floor", "ceil", "round",
    "exp", "exp2", "log", "log1p", "tanh", "logistic", "sqrt", "rsqrt", "pow", "integer_pow", "square",
    "sin", "cos", "erf", "atan2",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
    "select_n", "convert_element_type", "clamp", "stop_gradient", "copy", "copy_p",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "is_finite",
}  # fmt: skip
# Call-like primitives whose body is inlined (jnp.where and friends are jitted).
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Eqn:
    primitive: typing.Any
    inputs: tuple  # value ids (ints) or ("literal", value)
    outputs: tuple  # value ids
    params: tuple  # (name, value) pairs
    deps: frozenset  # which of SCORE, BATCH, HEAD, QUERY, KEY the outputs depend on


@dataclasses.dataclass(frozen=True)
class _Flat:
    """A program's jaxpr as a flat list of equations (calls inlined), with each value's dtype, dependencies and
    whether a float closed-over array reaches it through differentiable operations."""

    eqns: tuple
    inputs: tuple  # value ids: the closed-over arrays, then the program's named arguments
    output: typing.Any  # a value id, or ("literal", value)
    dtypes: dict
    deps: dict
    grads: dict


def _flatten(program: Program) -> _Flat:
    eqns, counter = [], iter(range(1 << 30))
    dtypes, deps, grads = {}, {}, {}

    def new_value(aval, dep, grad):
        vid = next(counter)
        dtypes[vid], deps[vid] = aval.dtype, dep
        grads[vid] = grad and jnp.issubdtype(aval.dtype, jnp.floating)
        return vid

    def walk(jaxpr, env):
        def read(atom):
            return ("literal", atom.val) if isinstance(atom, jex.Literal) else env[atom]

        for eqn in jaxpr.eqns:
            inputs = tuple(read(a) for a in eqn.invars)
            name = eqn.primitive.name
            if _CALLS.get(name) in eqn.params:
                body = eqn.params[_CALLS[name]]
                inner = dict(zip(body.jaxpr.constvars, (("literal", c) for c in body.consts)))
                inner.update(zip(body.jaxpr.invars, inputs))
                for var, value in zip(eqn.outvars, walk(body.jaxpr, inner)):
                    env[var] = value
                continue
            ids = [i for i in inputs if not isinstance(i, tuple)]
            dep = frozenset().union(*(deps[i] for i in ids))
            grad = name != "stop_gradient" and any(grads[i] for i in ids)
            outputs = tuple(new_value(var.aval, dep, grad) for var in eqn.outvars)
            env.update(zip(eqn.outvars, outputs))
            eqns.append(_Eqn(eqn.primitive, inputs, outputs, tuple(eqn.params.items()), dep))
        return [read(v) for v in jaxpr.outvars]

    jaxpr = program.jaxpr
    names = (None,) * program.num_consts + program.argnames
    inputs = tuple(
        new_value(var.aval, frozenset() if name is None else frozenset({name}), name is None)
        for var, name in zip(jaxpr.invars, names)
    )
    output = walk(jaxpr, dict(zip(jaxpr.invars, inputs)))[0]
    return _Flat(tuple(eqns), inputs, output, dtypes, deps, grads)


def _is_joint(deps) -> bool:
    return SCORE in deps or (QUERY in deps and KEY in deps)


@dataclasses.dataclass(frozen=True)
class _Staged:
    """One staged value: a scalar the joint part reads, computed per query (side "row") or per key ("col")."""

    value: int  # its id in the flat program
    side: str  # "row" or "col"
    kind: str  # "int" (int32 or bool, stored int32) or "float" (stored float32)
    dtype: typing.Any  # its own dtype, restored when read
    batch: bool  # varies with the batch index
    head: bool  # varies with the (query) head index
    differentiable: bool


@dataclasses.dataclass(frozen=True, eq=False)
class Staged:
    """A program split for the kernels (see the module docstring). Static: hashable by its program and whether
    its values need gradients.

    The kernels read four stacks (each None when empty), indexed [batch or 0, head or 0, value, position]:
    rows_int int32 / rows_float float32 [Bd, Hd, R, q_len] and cols_int / cols_float [Bd, Hd, C, kv_len],
    where Bd is batch or 1 and Hd heads or 1 (`dims(side)` says which), and call `joint` on tiles."""

    program: Program
    flat: _Flat
    staged: tuple  # _Staged, ordered row int, row float, col int, col float (each group in stack order)

    def __hash__(self):
        return hash((self.program, self.needs_grad))

    def __eq__(self, other):
        return isinstance(other, Staged) and (self.program, self.needs_grad) == (other.program, other.needs_grad)

    def without_grads(self) -> Staged:
        """This program with no value differentiable, for a call whose closed-over arrays need no gradient
        (constants, or stopped): the backward kernels then compute none."""
        return dataclasses.replace(
            self, staged=tuple(dataclasses.replace(s, differentiable=False) for s in self.staged)
        )

    def group(self, side: str, kind: str) -> list:
        return [s for s in self.staged if s.side == side and s.kind == kind]

    @property
    def ors_query_term(self) -> bool:
        """Whether the program ORs in a term that reads the query position but not the key's (global queries, as
        Longformer's): a key tile's visible queries may then form two runs, whose gap the dK/dV pass steps over."""

        def query_only(atom):
            deps = frozenset() if isinstance(atom, tuple) else self.flat.deps[atom]
            return QUERY in deps and KEY not in deps and SCORE not in deps

        return any(eqn.primitive.name == "or" and any(map(query_only, eqn.inputs)) for eqn in self.flat.eqns)

    def dims(self, side: str) -> tuple[bool, bool]:
        """(varies with batch, varies with head) of one side's stacks."""
        values = [s for s in self.staged if s.side == side]
        return any(s.batch for s in values), any(s.head for s in values)

    @property
    def needs_grad(self) -> bool:
        """Whether a float closed-over array reaches the result differentiably: the kernels then return the
        gradient of the float stacks."""
        return any(s.differentiable for s in self.staged)

    def stacks(self, consts, batch: int, heads: int, q_len: int, kv_len: int):
        """(rows_int, rows_float, cols_int, cols_float) for every position, computed in XLA; the float stacks are
        differentiable in `consts`."""
        out = []
        for side, length in (("row", q_len), ("col", kv_len)):
            bd, hd = self.dims(side)
            b = jnp.arange(batch if bd else 1, dtype=jnp.int32)
            h = jnp.arange(heads if hd else 1, dtype=jnp.int32)
            pos = jnp.arange(length, dtype=jnp.int32)
            for kind in ("int", "float"):
                group = self.group(side, kind)
                if not group:
                    out.append(None)
                    continue

                def values(b, h, pos, group=group, side=side):
                    q, k = (pos, jnp.int32(0)) if side == "row" else (jnp.int32(0), pos)
                    env = self._prefix(consts, b, h, q, k, [s.value for s in group])
                    return jnp.stack([_encode(env[s.value], s.kind) for s in group])

                over_pos = jax.vmap(values, (None, None, 0), 1)  # [values, length]
                over_heads = jax.vmap(over_pos, (None, 0, None))
                out.append(jax.vmap(over_heads, (0, None, None))(b, h, pos))
        return tuple(out)

    def _prefix(self, consts, b, h, q, k, wanted):
        """Run the equations the `wanted` values need (none of them joint)."""
        flat, needed = self.flat, set(wanted)
        for eqn in reversed(flat.eqns):
            if any(o in needed for o in eqn.outputs):
                needed.update(i for i in eqn.inputs if not isinstance(i, tuple))
        score = (jnp.float32(0),) if self.program.kind == "score" else ()
        env = dict(zip(flat.inputs, (*consts, *score, b, h, q, k)))
        for eqn in flat.eqns:
            if any(o in needed for o in eqn.outputs):
                _run(eqn, env)
        return env

    def joint(self, score, batch, head, q_idx, kv_idx, rows_int=(), rows_float=(), cols_int=(), cols_float=(), *,
              tile=None, q_axis=None, tile_shape=None, scale=1.0, max_position=None, split=False, row_terms=False,
              key_before_query=False, origin=None):  # fmt: skip
        """The program's result on one tile of logits (the score `scale * score`, float32; None for a mask_mod).

        Tiles (q_axis None): q_idx, kv_idx: int32 positions broadcast to the tile; rows_* / cols_*: the tile's
        staged values (one per entry of that stack, as stored: int32 or float32), broadcast to it; batch, head:
        int32 scalars (or tiles). `tile(x)` broadcasts a scalar to the tile (default jnp.broadcast_to).

        Vectors (q_axis 0 or 1, the Hopper kernels' form): q_idx and rows_* are vectors [bq] of the tile's
        queries, kv_idx and cols_* vectors [bk] of its keys; the tile is [bq, bk] (q_axis 0) or [bk, bq]. Each
        operation runs at the smallest shape of its operands (scalar, query vector, key vector, tile), so a
        vector reaches the tile (`lax.broadcast_in_dim` along its axis) only where it meets a value of the other
        axis or the score.

        Either form (`_TileEvaluator`): multiplies by constants (`scale`, the program's literals) are folded
        into one factor, applied where the value meets another or, with `split`, left to the caller; with
        `max_position` (every position is below it), int->float conversions of values made of positions and
        integer literals are moved onto the positions where float32 stays exact. Returns the modified score
        (float32) or the mask (bool), tile-shaped; with `split` (a score program), (x, c): the score is c * x,
        c a Python float that a kernel folds into its own multiply-add; with `split` and `row_terms` (vector form),
        (x, c, row): the score is c * x + row, row None or a float32 vector of the tile's queries that a kernel
        adds to its per-row quantities instead of to each logit (`key_before_query`: every key the kernel keeps
        visible is at or before its query, so |k - q| may be read as q - k; `_TileEvaluator`). `origin`: None
        or an int32 scalar that float32 conversions of the positions count from (for a `translation_invariant`
        program: the same result, with float32 values that stay small at long context).

        In the vector form q_idx and kv_idx may be functions that make the vectors (with `tile_shape`, the tile's
        shape): they are called only if the joint part reads them, so a kernel creates no position it does not
        use (an unused register value with a layout defeats Mosaic GPU's layout inference)."""
        evaluator, out = self._evaluate(score, batch, head, q_idx, kv_idx, rows_int, rows_float, cols_int, cols_float,
                                        tile=tile, q_axis=q_axis, tile_shape=tile_shape, scale=scale,
                                        max_position=max_position, row_terms=split and row_terms,
                                        key_before_query=key_before_query, origin=origin)  # fmt: skip
        has_score = self.program.kind == "score"
        row = None
        if has_score and split and row_terms and out.row is not None and out.side == TILE and out.literal is None:
            out, row = dataclasses.replace(out, row=None), out.row.astype(jnp.float32)
        out = evaluator.flat_row(out)
        if not has_score:
            return evaluator.broadcast(evaluator.materialize(out), out.side, TILE)
        if split and out.literal is None and out.side == TILE:
            x = out.x if out.factor is None else out.x * evaluator.broadcast(out.factor, out.factor_side, TILE)
            x, c = x.astype(jnp.float32), out.coef
        else:
            x, c = evaluator.broadcast(evaluator.materialize(out), out.side, TILE).astype(jnp.float32), 1.0
        if not split:
            return x
        return (x, c, row) if row_terms else (x, c)

    def offsets(self, batch, head, q_idx, kv_idx, rows_int=(), rows_float=(), cols_int=(), cols_float=(), *,
                q_axis, tile_shape, scale, max_position=None, key_before_query=False, origin=None):  # fmt: skip
        """For a score program linear in the score with a positive slope a (`score_slope`), in the vector form:
        (offset, row) such that the result on scale * s is a * scale * (s + offset) + row. offset: None or a
        float32 tile in the raw logits' units (the score-free part over a * scale: infinite past float32's range),
        which a kernel can place in the accumulator that s comes out of, so that the tile costs nothing after s
        is ready; row: None or a float32 vector of the tile's queries (as `joint`'s row term). Arguments as
        `joint`'s."""
        slope = self.score_slope
        if slope is None or slope <= 0 or q_axis is None:
            raise ValueError(f"offsets needs a score program with a positive constant slope, got {slope}")
        evaluator, out = self._evaluate(None, batch, head, q_idx, kv_idx, rows_int, rows_float, cols_int, cols_float,
                                        q_axis=q_axis, tile_shape=tile_shape, max_position=max_position,
                                        row_terms=True, key_before_query=key_before_query, origin=origin)  # fmt: skip
        row = None if out.row is None else out.row.astype(jnp.float32)
        out = dataclasses.replace(out, row=None)
        if out.literal is not None and out.literal == 0:
            return None, row
        if out.side in (SCALAR, ROW):  # a per-query term: all of it goes to the row
            x = evaluator.broadcast(jnp.asarray(evaluator.materialize(out)), out.side, ROW).astype(jnp.float32)
            return None, x if row is None else row + x
        factor = 1.0 / (slope * scale)
        scaled = evaluator.scaled(out, factor)
        x = evaluator.materialize(out) * np.float32(factor) if scaled is None else evaluator.materialize(scaled)
        return evaluator.broadcast(x, out.side, TILE).astype(jnp.float32), row

    def _evaluate(self, score, batch, head, q_idx, kv_idx, rows_int, rows_float, cols_int, cols_float, *, q_axis,
                  tile_shape, max_position, row_terms, key_before_query, origin, tile=None, scale=1.0):  # fmt: skip
        """(the `_TileEvaluator`, the program's output `_Value`) of `joint`'s arguments; score None: a literal
        0 (the score-free part of a program linear in the score)."""
        kinds = (("row", "int", rows_int), ("row", "float", rows_float),
                 ("col", "int", cols_int), ("col", "float", cols_float))  # fmt: skip
        if q_axis is None:
            shape = (score if score is not None else q_idx).shape
            side_of = {"row": TILE, "col": TILE}
        else:
            if tile_shape is None:
                lengths = (q_idx.shape[0], kv_idx.shape[0])
                tile_shape = lengths if q_axis == 0 else lengths[::-1]
            shape = tuple(tile_shape)
            side_of = {"row": ROW, "col": COL}
        inputs = self.flat.inputs[self.program.num_consts :]
        has_score = self.program.kind == "score"
        given = [(batch, TILE), (head, TILE), (q_idx, side_of["row"]), (kv_idx, side_of["col"])]
        if has_score:
            given.insert(0, (score, TILE))
        for side, kind, values in kinds:
            group = self.group(side, kind)
            if len(values or ()) != len(group):
                raise ValueError(f"{side}s_{kind} has {len(values or ())} values; this program stages {len(group)}")
            for s, x in zip(group, values or ()):
                given.append(((x != 0) if s.dtype == jnp.bool_ else x.astype(s.dtype), side_of[side]))
        vids = [*inputs, *(s.value for side, kind, _ in kinds for s in self.group(side, kind))]
        env = {}
        for vid, (x, side) in zip(vids, given):
            if x is None:  # the score in `offsets`, below
                continue
            if callable(x):
                env[vid] = _Lazy(x, side)
                continue
            x = jnp.asarray(x)
            env[vid] = _Value(x, SCALAR if x.ndim == 0 else side)
        if not self.translation_invariant:  # positions read otherwise than as their difference: no origin
            origin = None
        if has_score and score is None:  # the score-free part of a program linear in the score
            env[inputs[0]] = _Value(np.float32(0), SCALAR, literal=0.0)
        elif has_score:
            env[inputs[0]] = dataclasses.replace(env[inputs[0]], coef=float(scale))
        evaluator = _TileEvaluator(
            self.flat,
            env,
            shape=shape,
            q_axis=q_axis,
            tile=tile or (lambda x: jnp.broadcast_to(x, shape)),
            positions=inputs[-2:] if max_position is not None else (),
            max_position=max_position,
            indices=inputs[-2:],
            row_terms=row_terms,
            key_before_query=key_before_query,
            origin=origin,
        )
        return evaluator, evaluator.operand(self.flat.output)

    @property
    def translation_invariant(self) -> bool:
        """Whether the program reads the positions only as their difference (q_idx - kv_idx or kv_idx - q_idx):
        then their float32 values may count from a common origin in the tile (`joint`'s origin, its first
        key), which keeps them small at long context."""
        q, k = self.flat.inputs[-2:]
        for eqn in self.flat.eqns:
            if q in eqn.inputs or k in eqn.inputs:
                if eqn.primitive.name != "sub" or tuple(eqn.inputs) not in ((q, k), (k, q)):
                    return False
        return self.flat.output not in (q, k)

    @property
    def score_derivative(self) -> float | None:
        """d result / d score where it is a constant (the score passes through adds, subtracts, negations,
        multiplies and divides by literals, float conversions and selects whose cases agree), else None: with
        1.0 (ALiBi, biases) a kernel's pullback of the score is the identity."""
        return self._slope(values=False)

    @property
    def score_slope(self) -> float | None:
        """a where the result is a * score + (a value free of the score), else None: as `score_derivative`, but
        of values (a stop_gradient passes the score on; a select's predicate must not read it; float32
        conversions only, since a narrower one rounds). `offsets` needs it."""
        return self._slope(values=True)

    def _slope(self, *, values: bool) -> float | None:
        flat = self.flat
        if self.program.kind != "score":
            return None
        producer = {o: e for e in flat.eqns for o in e.outputs}
        memo = {}

        def slope(atom):
            if isinstance(atom, tuple) or SCORE not in flat.deps[atom]:
                return 0.0
            if atom not in memo:
                memo[atom] = _derivative_rule(producer.get(atom), slope, flat=flat if values else None)
            return memo[atom]

        return slope(flat.output)

    def block_classes(self, stacks, *, batch: int, heads: int, q_len: int, kv_len: int, block_q: int,
                      block_kv: int):  # fmt: skip
        """`block_classes` of this (mask) program from its stacks (`stacks`), as the kernels see them: by interval
        arithmetic where every joint operation has a rule, else at every position. Bd/Hd as `block_classes`,
        widened to the stacks' own batch/head dims."""
        present = [s for s in stacks if s is not None]
        bd, hd = varies(self.program)
        nb = batch if bd or any(s.shape[0] > 1 for s in present) else 1
        nh = heads if hd or any(s.shape[1] > 1 for s in present) else 1
        try:
            return _staged_block_classes(self, stacks, batch=nb, heads=nh, q_len=q_len, kv_len=kv_len,
                                         block_q=block_q, block_kv=block_kv)  # fmt: skip
        except _NoRule:
            return _dense_block_classes(self.program, None, batch, heads, q_len, kv_len, block_q, block_kv, self,
                                        list(stacks))  # fmt: skip


def _run(eqn, env):
    args = [jnp.asarray(i[1]) if isinstance(i, tuple) else env[i] for i in eqn.inputs]
    out = eqn.primitive.bind(*args, **dict(eqn.params))
    env.update(zip(eqn.outputs, out if eqn.primitive.multiple_results else [out]))


def _encode(x, kind):
    return x.astype(jnp.int32) if kind == "int" else x.astype(jnp.float32)


def _derivative_rule(eqn, derivative, flat=None):
    """d eqn's output / d score from its inputs' (`derivative` of an atom; None where not a constant). No eqn:
    the score itself. With `flat` (the program), the slope of its value instead (`Staged.score_slope`)."""
    if eqn is None:
        return 1.0
    name, inputs = eqn.primitive.name, eqn.inputs
    if flat is not None:
        if name == "stop_gradient":  # the identity on values
            return derivative(inputs[0])
        if name == "convert_element_type" and not (
            flat.dtypes[inputs[0]] == flat.dtypes[eqn.outputs[0]] == jnp.float32
        ):
            return None  # a narrower float or an integer rounds the score
        if name == "select_n" and not isinstance(inputs[0], tuple) and SCORE in flat.deps[inputs[0]]:
            return None  # which case is taken depends on the score
    ds = [derivative(i) for i in inputs]
    literal = [float(i[1]) if isinstance(i, tuple) else None for i in inputs]
    if name in ("add", "sub", "neg", "convert_element_type", "copy", "copy_p") and all(d is not None for d in ds):
        if name == "sub":
            return ds[0] - ds[1]
        return -ds[0] if name == "neg" else sum(ds)
    if name == "mul" and any(x is not None for x in literal) and all(d is not None for d in ds):
        return ds[0] * literal[1] if literal[1] is not None else ds[1] * literal[0]
    if name == "div" and literal[1] not in (None, 0.0) and ds[0] is not None:
        return ds[0] / literal[1]
    if name == "select_n" and ds[1] is not None and all(d == ds[1] for d in ds[1:]):
        return ds[1]
    if name == "stop_gradient":
        return 0.0
    return None


# ---- Evaluating the joint part on a tile ----------------------------------------------------------------------
# A value's side says which axes of the tile it varies along: bit 1 the queries, bit 2 the keys (so sides join
# by `|`). It is computed at its side's shape (a scalar, a vector of the tile's queries or keys, or the tile) and
# broadcast only where it meets a value of another side: a per-key bias costs one vector op per key, not one op
# per logit, until it is added to the score.
SCALAR, ROW, COL, TILE = 0, 1, 2, 3
# Integers of magnitude up to 2**24 are exact in float32.
EXACT_FLOAT32_INTEGERS = 1 << 24
# Folded constant factors stay well inside float32's range, so that folding never overflows where the
# program's own multiplies would not.
_FOLD_RANGE = (1e-30, 1e30)
# float32 1.5 * 2**23, whose bits plus an integer n with |n| < 2**22 are the float 1.5 * 2**23 + n (its ulp is 1).
_BIAS_FLOAT, _BIAS_BITS = np.float32(1.5 * 2**23), np.int32(0x4B400000)
# Positions below this convert by `_int_to_float`'s integer add and float subtract.
_BIASED_CONVERSION_LIMIT = 1 << 22
# Integer ops through which an int->float conversion moves toward the positions: exact in float32 while every
# intermediate is an integer below EXACT_FLOAT32_INTEGERS (`_TileEvaluator.bound`).
_EXACT_IN_FLOAT = {"add", "sub", "neg", "abs", "max", "min", "mul", "clamp", "select_n"}


@dataclasses.dataclass(frozen=True)
class _Value:
    """A value of the joint part at its side's shape: coef * factor * x. coef: a Python float (the logits'
    scale and the program's multiplies by literals, folded); factor: None or, for a tile, a float array of a
    smaller side that multiplies it (a per-query slope times a tile of distances). Both reach x once, inside
    the multiply-add where the value meets another, or where an operation needs it plain. literal: the
    Python value of a literal operand. row: None or a query vector added to the whole (kept apart only by an
    evaluator with `row_terms`)."""

    x: typing.Any
    side: int
    coef: float = 1.0
    factor: typing.Any = None
    factor_side: int = SCALAR
    literal: typing.Any = None
    row: typing.Any = None  # an additive float32 vector of the tile's queries, not yet added (`row_terms`)


@dataclasses.dataclass(frozen=True)
class _Lazy:
    """An input made only when the joint part reads it."""

    make: typing.Any
    side: int


def _negated(v: _Value) -> _Value:
    return dataclasses.replace(v, coef=-v.coef, row=None if v.row is None else -v.row)


class _TileEvaluator:
    """The joint part of a flat program on one tile, demand-driven from its output (`Staged.joint`): `env` maps
    the program's named inputs and staged values to `_Value`s; `positions` are the query and key positions'
    value ids (empty: no conversion is moved), each below `max_position`; `indices` the (query, key) position
    inputs' ids.

    With `row_terms` (the vector form only), a sum of a query vector and a key vector or tile keeps the query
    vector apart (`_Value.row`) through sums, negations and multiplies by constants or query vectors, so that
    a kernel can fold it into its per-row softmax shift instead of adding it to every logit. With
    `key_before_query` (every visible key is at or before its query: a band whose right edge is <= 0),
    |k - q| is q - k, which is such a sum (causal ALiBi costs one multiply-add per logit). `origin`: None or an
    int32 scalar that position values converted to float32 count from (`_int_to_float`)."""

    def __init__(self, flat, env, *, shape, q_axis, tile, positions, max_position, indices=(),
                 row_terms=False, key_before_query=False, origin=None):  # fmt: skip
        self.flat, self.values, self.floats, self.bounds = flat, dict(env), {}, {}
        self.producer = {o: e for e in flat.eqns for o in e.outputs}
        self.shape, self.q_axis, self.tile = shape, q_axis, tile
        self.positions, self.max_position = set(positions), max_position
        self.indices, self.row_terms = tuple(indices), row_terms and q_axis is not None
        self.key_before_query, self.origin = key_before_query, origin

    def broadcast(self, x, side, to):
        """x of `side` at side `to` (which contains it)."""
        if side == to:
            return x
        if side == SCALAR:
            if to == TILE:
                return self.tile(x)
            return jnp.broadcast_to(x, (self.shape[(0 if to == ROW else 1) ^ self.q_axis],))
        return lax.broadcast_in_dim(x, self.shape, [self.q_axis if side == ROW else 1 - self.q_axis])

    def flat_row(self, v: _Value) -> _Value:
        """v with its row term (if any) added: a plain value at its side joined with the queries'."""
        if v.row is None:
            return v
        side = v.side | ROW
        x = self.broadcast(jnp.asarray(self.materialize(dataclasses.replace(v, row=None))), v.side, side)
        return _Value(x + self.broadcast(v.row, ROW, side), side)

    def band_abs(self, eqn, value_of):
        """|q - k| or |k - q| as q - k under `key_before_query` (`value_of` reads the difference: `operand` or
        `as_float`), else None."""
        if not self.key_before_query or eqn.primitive.name != "abs" or len(self.indices) != 2:
            return None
        inner = self.producer.get(eqn.inputs[0])
        if inner is None or inner.primitive.name != "sub" or tuple(inner.inputs) not in (self.indices,
                                                                                      self.indices[::-1]):  # fmt: skip
            return None
        difference = value_of(eqn.inputs[0])
        if tuple(inner.inputs) == self.indices:  # q - k
            return difference
        dtype = difference.x.dtype if difference.row is None else jnp.float32
        (negated,) = self.compute(lax.neg_p, {}, [difference], dtype)
        return negated

    def materialize(self, v: _Value):
        """v as a plain array at its side (v has no row term: `flat_row`)."""
        if v.factor is not None:
            factor = v.factor if v.coef == 1.0 else v.factor * np.float32(v.coef)
            return v.x * self.broadcast(factor, v.factor_side, v.side)
        return v.x if v.coef == 1.0 else v.x * np.asarray(v.coef, v.x.dtype)

    def operand(self, atom) -> _Value:
        if isinstance(atom, tuple):
            x = np.asarray(atom[1])
            return _Value(x, SCALAR, literal=x.item())
        if atom not in self.values:
            eqn = self.producer[atom]
            self.values.update(zip(eqn.outputs, self.apply(eqn)))
        value = self.values[atom]
        if isinstance(value, _Lazy):  # made on first use
            x = jnp.asarray(value.make())
            value = self.values[atom] = _Value(x, SCALAR if x.ndim == 0 else value.side)
        return value

    def apply(self, eqn) -> list:
        banded = self.band_abs(eqn, self.operand)
        if banded is not None:
            return [banded]
        out_dtype = self.flat.dtypes[eqn.outputs[0]]
        if eqn.primitive.name == "convert_element_type" and out_dtype == jnp.float32 and self.exact(eqn.inputs[0]):
            return [self.as_float(eqn.inputs[0])]
        return self.compute(eqn.primitive, dict(eqn.params), [self.operand(i) for i in eqn.inputs], out_dtype)

    def compute(self, primitive, params, args, out_dtype) -> list:
        if all(a.literal is not None for a in args) and not primitive.multiple_results:  # folded at trace time
            with jax.ensure_compile_time_eval():
                out = np.asarray(primitive.bind(*(np.asarray(a.literal, a.x.dtype) for a in args), **params))
            return [_Value(out, SCALAR, literal=out.item())]
        if out_dtype == jnp.float32 and not primitive.multiple_results:
            folded = self.fold(primitive.name, args)
            if folded is not None:
                return [folded]
        args = [self.flat_row(a) for a in args]
        side = functools.reduce(operator.or_, (a.side for a in args), SCALAR)
        xs = [self.broadcast(jnp.asarray(self.materialize(a)), a.side, side) for a in args]
        out = primitive.bind(*xs, **params)
        return [_Value(x, side) for x in (out if primitive.multiple_results else [out])]

    # -- folding constants and factors (float32 values only)

    def fold(self, name, args):
        """The float32 result of `name` as a `_Value` with its constants and factors still folded, or None
        where the operation needs its operands plain."""
        if name == "mul":
            a, b = args
            if (a.literal is None) == (b.literal is None):
                if a.literal is not None:
                    return None
                return self.product_rows(a, b) if a.row is not None or b.row is not None else self.product(a, b)
            value, literal = (a, b.literal) if b.literal is not None else (b, a.literal)
            return self.scaled(value, float(literal))
        if name == "div" and args[1].literal is not None and args[0].literal is None and args[1].literal != 0:
            return self.scaled(args[0], 1.0 / float(args[1].literal))
        zero = [a.literal is not None and a.literal == 0 for a in args]
        if name in ("add", "sub") and any(zero):  # x + 0, x - 0, 0 + x, 0 - x (x no literal: `compute`)
            a, b = args
            return a if zero[1] else b if name == "add" else _negated(b)
        if any(a.literal is not None for a in args):
            return None
        if name == "neg":
            return _negated(args[0])
        if any(a.row is not None for a in args):
            if name in ("add", "sub"):
                a, b = args
                return self.sum_rows(a, _negated(b) if name == "sub" else b)
            return None
        if name in ("add", "sub"):
            a, b = args
            return self.sum(a, _negated(b) if name == "sub" else b)
        plain = all(a.factor is None for a in args)
        if name == "abs" and plain:
            a = args[0]
            return _Value(lax.abs(a.x), a.side, abs(a.coef))
        cases = args[1:] if name == "select_n" else args
        if name in ("max", "min", "select_n") and plain and len({a.coef for a in cases}) == 1:
            coef = cases[0].coef
            if name != "select_n" and coef < 0:
                return None
            side = functools.reduce(operator.or_, (a.side for a in args), SCALAR)
            xs = [self.broadcast(a.x, a.side, side) for a in args]
            return _Value({"max": lax.max, "min": lax.min, "select_n": lax.select_n}[name](*xs), side, coef)
        return None

    @staticmethod
    def scaled(v: _Value, c: float):
        coef = v.coef * c
        if v.literal is not None or not _FOLD_RANGE[0] < abs(coef) < _FOLD_RANGE[1]:
            return None
        return dataclasses.replace(v, coef=coef, row=None if v.row is None else v.row * np.float32(c))

    def sum_rows(self, a: _Value, b: _Value):
        """a + b where either carries a row term: the rest summed (`sum`, else plainly), the row terms added."""
        rest = [dataclasses.replace(v, row=None) for v in (a, b)]
        out = self.sum(*rest) or self.compute(lax.add_p, {}, rest, jnp.float32)[0]
        rows = [r for r in (a.row, b.row, out.row) if r is not None]
        return dataclasses.replace(out, row=functools.reduce(operator.add, rows))

    def product_rows(self, a: _Value, b: _Value):
        """a * b where one carries a row term and the other is a plain scalar or query vector, else None."""
        if b.row is not None:
            a, b = b, a
        if b.row is not None or b.factor is not None or b.side not in (SCALAR, ROW):
            return None
        rest = self.product(dataclasses.replace(a, row=None), b)
        if rest is None:
            return None
        factor = self.broadcast(jnp.asarray(self.materialize(b)), b.side, ROW)
        return dataclasses.replace(rest, row=a.row * factor)

    def product(self, a: _Value, b: _Value):
        """a * b: a tile times a smaller value keeps the smaller one as (part of) its factor."""
        coef = a.coef * b.coef
        if not _FOLD_RANGE[0] < abs(coef) < _FOLD_RANGE[1]:
            return None
        if a.side != TILE and b.side != TILE:  # no factors: the product at the joined side
            side = a.side | b.side
            if self.row_terms and {a.side, b.side} == {ROW, COL}:  # the query vector stays a factor
                (col, row) = (a, b) if a.side == COL else (b, a)
                return _Value(self.broadcast(col.x, COL, TILE), TILE, coef, row.x, ROW)
            return _Value(self.broadcast(a.x, a.side, side) * self.broadcast(b.x, b.side, side), side, coef)
        if a.side != TILE:
            a, b = b, a
        x, factor = a.x, (a.factor, a.factor_side)
        if b.side == TILE:
            x = x * b.x
            other = (b.factor, b.factor_side)
        else:
            other = (b.x, b.side)
        joined = self.joined_factor(factor, other)
        if joined is None:  # a row factor and a column factor: one of them reaches the tile now
            x, joined = x * self.broadcast(factor[0], factor[1], TILE), other
        return _Value(x, TILE, coef, *joined)

    def joined_factor(self, f, g):
        """The product of two factors (array, side) or None where they make a tile."""
        if f[0] is None or g[0] is None:
            return g if f[0] is None else f
        side = f[1] | g[1]
        if side == TILE:
            return None
        return self.broadcast(f[0], f[1], side) * self.broadcast(g[0], g[1], side), side

    def sum(self, a: _Value, b: _Value):
        """a + b. Two tiles: the one without a factor keeps its constant and the other is scaled by the ratio,
        one multiply-add. A tile and a smaller value: None (plain, which is the tile's constant in one
        multiply-add with the other)."""
        side = a.side | b.side
        if self.row_terms:
            for u, w in ((a, b), (b, a)):
                if u.side == ROW and u.factor is None and w.side in (COL, TILE):
                    return dataclasses.replace(w, row=jnp.asarray(self.materialize(u)))
        if a.factor is None and b.factor is None and a.coef == b.coef:
            return _Value(self.broadcast(a.x, a.side, side) + self.broadcast(b.x, b.side, side), side, a.coef)
        if a.side != TILE or b.side != TILE:
            return None
        for u, w in ((a, b), (b, a)):
            if u.factor is None:
                ratio = w.coef / u.coef
                if w.factor is None:
                    return _Value(u.x + w.x * np.float32(ratio), TILE, u.coef)
                return _Value(u.x + w.x * self.broadcast(w.factor * np.float32(ratio), w.factor_side, TILE), TILE,
                              u.coef)  # fmt: skip
        return None

    # -- int -> float conversions moved onto the positions

    def bound(self, atom):
        """A bound on |value| of an integer made of positions (each below max_position) and integer literals
        by `_EXACT_IN_FLOAT` operations (multiplies by a literal only), else None."""
        if isinstance(atom, tuple):
            x = np.asarray(atom[1])
            return abs(int(x)) if x.ndim == 0 and np.issubdtype(x.dtype, np.integer) else None
        if atom in self.positions:
            return self.max_position
        if atom in self.bounds:
            return self.bounds[atom]
        eqn, bound = self.producer.get(atom), None
        dtype = self.flat.dtypes[atom]
        if eqn is not None and eqn.primitive.name in _EXACT_IN_FLOAT and jnp.issubdtype(dtype, jnp.integer):
            name = eqn.primitive.name
            inputs = eqn.inputs[1:] if name == "select_n" else eqn.inputs
            bounds = [self.bound(i) for i in inputs]
            if name == "mul" and not any(isinstance(i, tuple) for i in inputs):
                bounds = [None]
            if all(b is not None for b in bounds):
                bound = {"add": sum, "sub": sum, "mul": math.prod}.get(name, max)(bounds)
        self.bounds[atom] = bound
        return bound

    def exact(self, atom) -> bool:
        bound = None if isinstance(atom, tuple) else self.bound(atom)
        return bound is not None and bound <= EXACT_FLOAT32_INTEGERS

    def as_float(self, atom) -> _Value:
        """An exact integer value (`exact`) converted to float32, each conversion on a position vector (or a
        literal) and the integer operations redone in float32."""
        if isinstance(atom, tuple):
            return self.operand(("literal", np.float32(atom[1])))
        if atom not in self.floats:
            eqn = self.producer.get(atom)
            if atom in self.positions or eqn is None:
                v = self.operand(atom)
                origin = self.origin if atom in self.positions else None
                self.floats[atom] = _Value(_int_to_float(v.x, self.bound(atom), origin), v.side)
            elif (banded := self.band_abs(eqn, self.as_float)) is not None:
                self.floats[atom] = banded
            else:
                args = [self.as_float(i) for i in eqn.inputs[1:]]
                first = eqn.inputs[0]  # a select's predicate stays as it is
                args.insert(0, self.operand(first) if eqn.primitive.name == "select_n" else self.as_float(first))
                (self.floats[atom],) = self.compute(eqn.primitive, dict(eqn.params), args, jnp.float32)
        return self.floats[atom]


def _int_to_float(x, bound, origin=None):
    """int32 x - origin (|x|, |origin| <= bound; origin None: 0) as float32, exactly. Below 2**22 by an integer
    add and a float subtract: on the GPU a conversion instruction shares the special-function units with the
    softmax's exp2, and a position vector is converted at every block. With an origin that changes from block
    to block, the result does too, so a kernel's compiler keeps it in the loop (a loop-invariant tile of
    positions hoisted out of the loop spilled)."""
    if bound is None or bound >= _BIASED_CONVERSION_LIMIT:
        return (x if origin is None else x - origin).astype(jnp.float32)
    # 1.5 * 2**23 + origin is exact, and so is the difference of two floats in [2**23, 2**24).
    shift = _BIAS_FLOAT if origin is None else _BIAS_FLOAT + jnp.asarray(origin).astype(jnp.float32)
    return lax.bitcast_convert_type(x + _BIAS_BITS, jnp.float32) - shift


def stage(program: Program) -> tuple[Staged | None, str | None]:
    """(Staged, None), or (None, why the kernels cannot run this program on tiles)."""
    flat = _flatten(program)
    raw = set(flat.inputs[program.num_consts :])
    staged = []
    for eqn in flat.eqns:
        if not _is_joint(eqn.deps):
            continue
        if eqn.primitive.name not in _ELEMENTWISE:
            what = "the score" if SCORE in eqn.deps else "both q_idx and kv_idx"
            return None, (
                f"its {eqn.primitive.name!r} depends on {what}: the kernels evaluate the joint part of a "
                f"{program.kind}_mod on register tiles, elementwise (index closed-over arrays by q_idx or by "
                "kv_idx alone)"
            )
        staged += [i for i in eqn.inputs if not isinstance(i, tuple) and i not in raw and not _is_joint(flat.deps[i])]
    if not isinstance(flat.output, tuple) and flat.output not in raw and not _is_joint(flat.deps[flat.output]):
        staged.append(flat.output)
    values = []
    for vid in dict.fromkeys(staged):  # first use order, once each
        dtype, dep = flat.dtypes[vid], flat.deps[vid]
        kind = "float" if jnp.issubdtype(dtype, jnp.floating) else "int"
        values.append(
            _Staged(vid, "col" if KEY in dep else "row", kind, dtype, BATCH in dep, HEAD in dep, flat.grads[vid])
        )
    order = [("row", "int"), ("row", "float"), ("col", "int"), ("col", "float")]
    values.sort(key=lambda s: order.index((s.side, s.kind)))
    return Staged(program, flat, tuple(values)), None


def varies(program: Program) -> tuple[bool, bool]:
    """(depends on the batch index, depends on the head index) of a program's result."""
    flat = _flatten(program)
    deps = frozenset() if isinstance(flat.output, tuple) else flat.deps[flat.output]
    return BATCH in deps, HEAD in deps


# Elements a dense block-class evaluation holds at once (a chunk of query blocks by every key): bounds its memory.
BLOCK_CLASS_CHUNK = 1 << 26


def block_classes(program: Program, consts, *, batch: int, heads: int, q_len: int, kv_len: int, block_q: int,
                  block_kv: int):  # fmt: skip
    """Which [block_q, block_kv] blocks a mask_mod leaves anything / everything visible in, on the device: (any,
    every), bool [Bd, Hd, num_q_blocks, num_kv_blocks], Bd = batch where the program varies with the batch index,
    else 1 (Hd likewise). Sound: a block marked empty (not any) sees nothing, one marked full (every) sees every
    position in range (positions past q_len / kv_len are ignored); others are partial. A stageable program whose
    joint part has interval rules is classed by interval arithmetic over each block's ranges of positions and
    staged values (O(blocks), no per-position work; exact for the built-in masks); others are evaluated at every
    position (exact)."""
    staged, _ = stage(program)
    if staged is None:
        return _dense_block_classes(program, consts, batch, heads, q_len, kv_len, block_q, block_kv)
    stacks = staged.stacks(consts, batch if staged.dims("row")[0] or staged.dims("col")[0] else 1,
                           heads if staged.dims("row")[1] or staged.dims("col")[1] else 1, q_len, kv_len)  # fmt: skip
    return staged.block_classes(stacks, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, block_q=block_q,
                                block_kv=block_kv)  # fmt: skip


def _dense_block_classes(program, consts, batch, heads, q_len, kv_len, block_q, block_kv, staged=None, stacks=None):
    """block_classes by evaluating every position: the program vmapped, or a staged one's joint part over its
    stacks; chunks of query blocks keep memory near BLOCK_CLASS_CHUNK elements."""
    bd, hd = varies(program)
    if stacks is not None:
        present = [s for s in stacks if s is not None]
        bd, hd = bd or any(s.shape[0] > 1 for s in present), hd or any(s.shape[1] > 1 for s in present)
    nb, nh = (batch if bd else 1), (heads if hd else 1)
    num_q, num_kv = -(-q_len // block_q), -(-kv_len // block_kv)
    kv_pad = num_kv * block_kv
    per_chunk = max(1, min(num_q, BLOCK_CLASS_CHUNK // max(1, nb * nh * block_q * kv_pad)))
    num_chunks = -(-num_q // per_chunk)
    rows_pad = num_chunks * per_chunk * block_q
    shape = (nb, nh, per_chunk * block_q, kv_pad)
    b = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32)[:, None, None, None], shape)
    h = jnp.broadcast_to(jnp.arange(nh, dtype=jnp.int32)[None, :, None, None], shape)
    k = jnp.broadcast_to(jnp.arange(kv_pad, dtype=jnp.int32)[None, None, None, :], shape)
    if stacks is not None:  # padded to whole chunks of rows and whole key blocks
        stacks = [None if s is None else _pad_last(s, rows_pad if i < 2 else kv_pad) for i, s in enumerate(stacks)]

    def values(stack, side, start):
        if stack is None:
            return []
        if side == "row":
            x = jax.lax.dynamic_slice_in_dim(stack, start, shape[2], axis=3)[..., None]  # [b, h, R, rows, 1]
        else:
            x = stack[..., None, :]  # [b, h, C, 1, kv]
        return [jnp.broadcast_to(x[:, :, j], shape) for j in range(x.shape[2])]

    def chunk(i):
        start = i * per_chunk * block_q
        q = start + jnp.broadcast_to(jnp.arange(shape[2], dtype=jnp.int32)[None, None, :, None], shape)
        if stacks is None:
            seen = program.apply(consts, b, h, q, k)
        else:
            rows_int, rows_float, cols_int, cols_float = stacks
            seen = staged.joint(None, b, h, q, k, values(rows_int, "row", start), values(rows_float, "row", start),
                                values(cols_int, "col", 0), values(cols_float, "col", 0))  # fmt: skip
        valid = (q < q_len) & (k < kv_len)
        blocks = (nb, nh, per_chunk, block_q, num_kv, block_kv)
        seen, valid = jnp.broadcast_to(seen, shape).reshape(blocks), valid.reshape(blocks)
        return (seen & valid).any(axis=(3, 5)), (seen | ~valid).all(axis=(3, 5))

    anything, everything = jax.lax.map(chunk, jnp.arange(num_chunks, dtype=jnp.int32))
    fold = lambda x: jnp.moveaxis(x, 0, 2).reshape(nb, nh, num_chunks * per_chunk, num_kv)[:, :, :num_q]
    return fold(anything), fold(everything)


def _pad_last(x, size):
    return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


# ---- Interval arithmetic for block classes ---------------------------------------------------------------------
# Each value is a pair (lo, hi) of arrays over blocks: every value it takes in the block lies in [lo, hi]. For a
# bool, lo means "true at every position", hi "true at some position". A rule may only widen, never narrow.


def _corners(f, a, b):
    values = [f(x, y) for x in a for y in b]
    lo, hi = values[0], values[0]
    for v in values[1:]:
        lo, hi = jnp.minimum(lo, v), jnp.maximum(hi, v)
    return lo, hi


def _increasing(f):
    return lambda a: (f(a[0]), f(a[1]))


def _abs(a):
    lo, hi = a
    crosses = (lo < 0) & (hi > 0)
    small, large = jnp.minimum(jnp.abs(lo), jnp.abs(hi)), jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    return jnp.where(crosses, jnp.zeros_like(lo), small), large


def _div(a, b):
    excludes_zero = (b[0] > 0) | (b[1] < 0)
    lo, hi = _corners(lambda x, y: lax.div(x, jnp.where(excludes_zero, y, jnp.ones_like(y))), a, b)
    if jnp.issubdtype(lo.dtype, jnp.floating):
        return jnp.where(excludes_zero, lo, -jnp.inf), jnp.where(excludes_zero, hi, jnp.inf)
    info = jnp.iinfo(lo.dtype)
    return jnp.where(excludes_zero, lo, info.min), jnp.where(excludes_zero, hi, info.max)


def _compare(op):
    def rule(a, b):
        if op == "lt":
            return a[1] < b[0], a[0] < b[1]
        if op == "le":
            return a[1] <= b[0], a[0] <= b[1]
        if op == "gt":
            return a[0] > b[1], a[1] > b[0]
        if op == "ge":
            return a[0] >= b[1], a[1] >= b[0]
        overlap = (a[0] <= b[1]) & (b[0] <= a[1])
        single = (a[0] == a[1]) & (b[0] == b[1]) & (a[0] == b[0])
        return (single, overlap) if op == "eq" else (~overlap, ~single)

    return rule


def _select(pred, *cases):
    if len(cases) != 2 or pred[0].dtype != jnp.bool_:
        raise _NoRule("select_n")
    low, high = cases
    either = (jnp.minimum(low[0], high[0]), jnp.maximum(low[1], high[1]))
    pick = lambda i: jnp.where(pred[0], high[i], jnp.where(~pred[1], low[i], either[i]))
    return pick(0), pick(1)


def _clamp(lower, x, upper):
    return lax.clamp(lower[0], x[0], upper[0]), lax.clamp(lower[1], x[1], upper[1])


def _square(a):
    lo, hi = _abs(a)
    return lo * lo, hi * hi


def _logical(name):
    def rule(*args):
        if args[0][0].dtype != jnp.bool_:
            raise _NoRule(name)  # bitwise on integers: no interval rule
        if name == "not":
            return ~args[0][1], ~args[0][0]
        a, b = args
        if name == "and":
            return a[0] & b[0], a[1] & b[1]
        if name == "or":
            return a[0] | b[0], a[1] | b[1]
        return (a[0] & ~b[1]) | (~a[1] & b[0]), (a[1] & ~b[0]) | (~a[0] & b[1])  # xor

    return rule


class _NoRule(Exception):
    pass


_INTERVAL_RULES = {
    "add": lambda a, b: (a[0] + b[0], a[1] + b[1]),
    "sub": lambda a, b: (a[0] - b[1], a[1] - b[0]),
    "neg": lambda a: (-a[1], -a[0]),
    "mul": lambda a, b: _corners(lambda x, y: x * y, a, b),
    "div": _div,
    "max": lambda a, b: (jnp.maximum(a[0], b[0]), jnp.maximum(a[1], b[1])),
    "min": lambda a, b: (jnp.minimum(a[0], b[0]), jnp.minimum(a[1], b[1])),
    "abs": _abs,
    "square": _square,
    "clamp": _clamp,
    "select_n": _select,
    **{name: _compare(name) for name in ("lt", "le", "gt", "ge", "eq", "ne")},
    **{name: _logical(name) for name in ("and", "or", "not", "xor")},
    **{
        name: _increasing(getattr(lax, name))
        for name in ("exp", "exp2", "log", "log1p", "tanh", "logistic", "sqrt", "floor", "ceil", "sign", "erf")
    },
    "round": _increasing(lax.round),
    "stop_gradient": lambda a: a,
    "copy": lambda a: a,
    "copy_p": lambda a: a,
}


def _interval(eqn, args):
    name = eqn.primitive.name
    if name == "convert_element_type":
        dtype = dict(eqn.params)["new_dtype"]
        return args[0][0].astype(dtype), args[0][1].astype(dtype)
    if name == "integer_pow" and dict(eqn.params)["y"] == 2:
        return _square(args[0])
    rule = _INTERVAL_RULES.get(name)
    if rule is None:
        raise _NoRule(name)
    return rule(*args)


def _block_extrema(stack, side, block, length, valid_len):
    """Per block of `block` positions along the last axis: (min, max) over the positions < valid_len, the
    stack [b, h, n, length] -> each [b, h, n, num_blocks]."""
    num = -(-length // block)
    x = _pad_last(stack, num * block).reshape(*stack.shape[:-1], num, block)
    valid = (jnp.arange(num * block) < valid_len).reshape(num, block)
    if jnp.issubdtype(x.dtype, jnp.floating):
        big, small = jnp.inf, -jnp.inf
    else:
        big, small = jnp.iinfo(x.dtype).max, jnp.iinfo(x.dtype).min
    return jnp.where(valid, x, big).min(-1), jnp.where(valid, x, small).max(-1)


def _staged_block_classes(staged, stacks, *, batch, heads, q_len, kv_len, block_q, block_kv):
    num_q, num_kv = -(-q_len // block_q), -(-kv_len // block_kv)
    qi = jnp.arange(num_q, dtype=jnp.int32)[None, None, :, None]
    ki = jnp.arange(num_kv, dtype=jnp.int32)[None, None, None, :]
    flat = staged.flat
    exact = lambda x: (x, x)
    env = dict(
        zip(
            flat.inputs[staged.program.num_consts :],
            [
                exact(jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]),
                exact(jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]),
                (qi * block_q, jnp.minimum(qi * block_q + block_q - 1, q_len - 1)),
                (ki * block_kv, jnp.minimum(ki * block_kv + block_kv - 1, kv_len - 1)),
            ],
        )
    )
    for (side, kind), stack in zip([("row", "int"), ("row", "float"), ("col", "int"), ("col", "float")], stacks):
        group = staged.group(side, kind)
        if not group:
            continue
        block, length = (block_q, q_len) if side == "row" else (block_kv, kv_len)
        lo, hi = _block_extrema(stack, side, block, stack.shape[-1], length)  # [b, h, n, blocks]
        for j, s in enumerate(group):
            lo_j, hi_j = lo[:, :, j], hi[:, :, j]
            expand = (lambda x: x[..., :, None]) if side == "row" else (lambda x: x[..., None, :])
            lo_j, hi_j = expand(lo_j), expand(hi_j)
            env[s.value] = (
                (lo_j != 0, hi_j != 0) if s.dtype == jnp.bool_ else (lo_j.astype(s.dtype), hi_j.astype(s.dtype))
            )
    for eqn in flat.eqns:
        if not _is_joint(eqn.deps):
            continue
        args = [exact(jnp.asarray(i[1])) if isinstance(i, tuple) else env[i] for i in eqn.inputs]
        (out,) = eqn.outputs
        env[out] = _interval(eqn, args)
    lo, hi = exact(jnp.asarray(flat.output[1])) if isinstance(flat.output, tuple) else env[flat.output]
    shape = (batch, heads, num_q, num_kv)
    return jnp.broadcast_to(hi, shape), jnp.broadcast_to(lo, shape)


# ---- Built-in mods --------------------------------------------------------------------------------------------
# Each returns a function for `score_mod=` or `mask_mod=` of `flash_attention`, written with the same mechanism a
# user would use. The band masks (causal, sliding_window, and_masks of them) also carry their band, which
# flash_attention runs as its built-in band: the same keys, with no mask program in the kernels.


def _with_band(mask_mod, band: masks.Band):
    """mask_mod, marked as `band` so that `flash_attention` runs it as its built-in band (`is_causal` /
    `local_window_size`): the same keys, with no mask program in the kernels."""
    mask_mod.band = band
    return mask_mod


def causal():
    """mask_mod: query i sees key j iff j <= i (positions from each sequence's start, as `is_causal`)."""
    return _with_band(lambda b, h, q, k: k <= q, masks.Band(None, 0))


def sliding_window(left: int | None, right: int | None = 0):
    """mask_mod: query i sees keys i - left .. i + right (None: unbounded on that side); right=0 is causal."""
    for name, side in (("left", left), ("right", right)):
        if side is not None and (not isinstance(side, int) or isinstance(side, bool) or side < 0):
            raise ValueError(f"sliding_window's {name} must be None or an int >= 0, got {side!r}")

    def mask_mod(b, h, q, k):
        seen = jnp.bool_(True)
        if left is not None:
            seen = seen & (k >= q - left)
        if right is not None:
            seen = seen & (k <= q + right)
        return seen

    return _with_band(mask_mod, masks.Band(left, right))


def document(segment_ids, kv_segment_ids=None):
    """mask_mod: a query sees only keys of its own document. segment_ids: int [batch, q_len]; kv_segment_ids:
    int [batch, kv_len] (default segment_ids)."""
    q_ids = jnp.asarray(segment_ids)
    kv_ids = q_ids if kv_segment_ids is None else jnp.asarray(kv_segment_ids)
    for name, ids in (("segment_ids", q_ids), ("kv_segment_ids", kv_ids)):
        if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"document's {name} must be an int array [batch, len], got {ids.dtype} {ids.shape}")
    return lambda b, h, q, k: q_ids[b, q] == kv_ids[b, k]


def prefix_lm(prefix_lengths):
    """mask_mod: keys before each example's prefix length are seen by every query (bidirectional prefix), the
    rest causally. prefix_lengths: int [batch]."""
    prefix = jnp.asarray(prefix_lengths)
    if prefix.ndim != 1 or not jnp.issubdtype(prefix.dtype, jnp.integer):
        raise ValueError(f"prefix_lm's prefix_lengths must be an int array [batch], got {prefix.dtype} {prefix.shape}")
    return lambda b, h, q, k: (k <= q) | (k < prefix[b])


def alibi(slopes):
    """score_mod: ALiBi, score - slope[head] * |kv_idx - q_idx|. slopes: float [heads] or [batch, heads]; they
    get gradients where they are differentiated (constant or stopped, the kernels compute none)."""
    slopes = jnp.asarray(slopes)
    if slopes.ndim not in (1, 2) or not jnp.issubdtype(slopes.dtype, jnp.floating):
        raise ValueError(f"alibi's slopes must be a float array [heads] or [batch, heads], got {slopes.shape}")
    slope = (lambda b, h: slopes[h]) if slopes.ndim == 1 else (lambda b, h: slopes[b, h])
    return lambda s, b, h, q, k: s - slope(b, h).astype(jnp.float32) * jnp.abs(k - q).astype(jnp.float32)


def soft_cap(cap: float):
    """score_mod: cap * tanh(score / cap) (Gemma 2, Grok)."""
    if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"soft_cap's cap must be a finite float > 0, got {cap!r}")
    cap = float(cap)
    inverse = 1.0 / cap  # a multiply in the kernels, where a division is a precise (slow) one
    return lambda s, b, h, q, k: cap * jnp.tanh(s * inverse)


def relative_position_bias(table):
    """score_mod: score + table[head, clip(kv_idx - q_idx, -m, m) + m], a learned bias per head and relative
    position (T5's without its log buckets). table: float [heads, 2 * m + 1]. Indexed by both positions, so
    it runs on the XLA paths (`xla_chunked`, `xla`), not in the Pallas or Hopper kernels."""
    table = jnp.asarray(table)
    if table.ndim != 2 or table.shape[1] % 2 != 1 or not jnp.issubdtype(table.dtype, jnp.floating):
        raise ValueError(f"relative_position_bias's table must be float [heads, 2 * m + 1], got {table.shape}")
    m = table.shape[1] // 2
    return lambda s, b, h, q, k: s + table[h, jnp.clip(k - q, -m, m) + m].astype(jnp.float32)


def and_masks(*mask_mods):
    """mask_mod: visible where every one of `mask_mods` says so (a band where every one is a band)."""

    def mask_mod(b, h, q, k):
        seen = jnp.bool_(True)
        for m in mask_mods:
            seen = seen & m(b, h, q, k)
        return seen

    bands = [getattr(m, "band", None) for m in mask_mods]
    if mask_mods and all(band is not None for band in bands):
        return _with_band(mask_mod, functools.reduce(operator.and_, bands))
    return mask_mod


def or_masks(*mask_mods):
    """mask_mod: visible where any one of `mask_mods` says so."""

    def mask_mod(b, h, q, k):
        seen = jnp.bool_(False)
        for m in mask_mods:
            seen = seen | m(b, h, q, k)
        return seen

    return mask_mod


def chain(*score_mods):
    """score_mod: the `score_mods` applied in order."""

    def score_mod(s, b, h, q, k):
        for m in score_mods:
            s = m(s, b, h, q, k)
        return s

    return score_mod
