"""numba kernels for separable image filters on CPU: the SSIM window (with SSIM's point-wise terms fused in) and
the training blur.

Why here and not ``torch.conv2d``: the speed of torch's CPU convolution depends on the build and the processor
(a depthwise 1-D convolution took 4x the rasterizer's time on one machine and a fraction on another). These loops
are plain multiply-adds over contiguous rows, which LLVM vectorises the same way everywhere.

Along a row (x) a filter is its taps run over a padded copy of the row: zeros or the mirrored pixels (reflect)
written once around the row, so every output pixel takes the same vectorised stencil (no border branches; a
border column done on its own costs as much as a whole vector of interior ones). The transpose of the
reflect-padded filter (the blur's backward) is the reversed taps over the zero-padded row, folded back onto the
pixels the padding mirrored.

Down the columns (y) a filter is a banded matrix ``M [n, n]`` (``out = M @ in``) stored as ``band [n, L]`` and
``start [n]`` with ``out[i] = sum_k band[i, k] * in[start[i] + k]`` (built in :mod:`.filters`, zero or reflect
padding, or their transposes). Each output row is then one stencil over ``L`` whole input rows, vectorised
along the row whatever its coefficients, so the border rows cost no more than the others.

Images are ``[P, H, W]`` planes (batch x channels flattened, any strides), float32 or float64 (one compiled
specialisation each). Each kernel is one parallel loop over chunks of rows of one plane (SSIM: over runs of rows
that may span planes). A chunk streams its rows (its own plus
the filter's reach) through ring buffers of the last ``L + 3`` row-filtered rows, each stored twice so that any
``L + 3`` consecutive ones are one block (see :func:`_col_stencil`): each input row is filtered along x once,
output rows go in batches of four, the column stencil over the ring as soon as their rows are in (four plain
rows in one pass that loads each ring row once for the four sums, :func:`_col_stencil4`), so the working
set is a few dozen rows (in L2 cache) whatever the chunk's height, and a chunk writes only its own output rows,
so the loops are race free. Taller chunks cost less: the rows in the filter's reach of a chunk are filtered by
both chunks that need them (:func:`splatflow.render.filters.chunk_rows` picks the height).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

ZERO, REFLECT, REFLECT_T = 0, 1, 2  # padding modes of the row filter (REFLECT_T: transpose of REFLECT)
BATCH_ROWS = 4  # output rows per batch of the column stencils (see :func:`_col_stencil4`, :func:`ssim_fused`)


@nb.njit(cache=True, inline="always")
def _typed(value, like):
    """``value`` as a scalar of ``like``'s dtype (float32 rows stay float32). Not ``np.array([value],
    dtype=...)[0]``: numba rewrites such constant-array calls, and that rewrite failed with ``AssertionError: key
    already in dictionary: '$np_typ_var.1'`` whenever this module's kernel was the first function a process
    compiled (its other kernels loaded from the cache), e.g. a training run after a run that never blurred."""
    out = np.empty(1, dtype=like.dtype)
    out[0] = value
    return out[0]


@nb.njit(cache=True)
def build_band(n, taps, reflect, transpose):
    """The band ``(band [n, L] float64, start [n], lo, hi)`` of the filter ``taps`` (odd length ``2r + 1``) along
    an axis of length ``n`` with zero (``reflect`` False) or reflect padding, or of its transpose (see
    :func:`splatflow.render.filters.band_matrix`); rows ``lo <= j < hi`` are the plain stencil. Built here rather
    than with numpy because the training blur's sigma changes every step (numpy took ~0.25 ms per band, mostly
    call overhead)."""
    L0 = taps.shape[0]
    r = (L0 - 1) // 2
    L = min(L0, n)
    start = np.empty(n, dtype=np.int64)
    for j in range(n):
        start[j] = min(max(j - r, 0), n - L)
    band = np.zeros((n, L), dtype=np.float64)
    for j in range(n):
        for k in range(L0):
            c = j + k - r
            if reflect:
                if c < 0:
                    c = -c
                if c > n - 1:
                    c = 2 * (n - 1) - c
            elif c < 0 or c >= n:
                continue
            row, col = (c, j) if transpose else (j, c)
            pos = col - start[row]
            if pos < 0 or pos >= L:
                raise ValueError("filter band too narrow (radius larger than the image side?)")
            band[row, pos] += taps[k]
    lo = hi = 0
    if L == L0:
        first = -1
        last = -1
        for j in range(n):
            plain = start[j] == j - r
            if plain:
                for k in range(L):
                    if band[j, k] != taps[k]:
                        plain = False
                        break
            if plain:
                if first < 0:
                    first = j
                last = j
            elif first >= 0 and last == j - 1:
                break  # the plain rows are one run; a non-plain row after it ends the run
        if first >= 0:
            lo, hi = first, last + 1
    return band, start, lo, hi


# -- the two stencils -------------------------------------------------------------------------------------------
# Both are called with a literal tap count ``L`` through :func:`_unrolled`, so LLVM unrolls the tap loop and
# vectorises the loop over the row (5x faster than a loop over a run-time length). Indices are plain ``range``
# counters: an index with a possibly negative offset makes numba test for wrap-around on every access, which stops
# vectorisation (13x slower). The column stencil (down the ring's rows) is a few lines of LLVM IR built here
# (:func:`_col_sum_ir`) rather than a numba loop, for one reason: numba cannot declare that its output rows do not
# overlap the rows it reads, and LLVM's run-time checks of that cost more per call than a short row's sums.

def _col_sum(blk, out, w, m, L):
    """``out[b, j] = sum_{k < L} w[k] blk[k + b, j]`` for ``j < m`` and the ``n`` rows ``b`` of ``out [n, W]``
    (``n`` 4; or one row, ``out [W]``), ``blk`` holding ``L + n - 1`` rows. Each block row is loaded once for
    the ``n`` sums (``L + 3`` loads per column instead of ``4 L`` for four rows: 1.5-1.7x faster than four
    one-row stencils). ``out`` must not overlap ``blk`` (see :func:`_col_sum_noalias`). Compiled through
    :func:`_col_sum_ov`."""
    raise NotImplementedError("only callable from numba-compiled code")


def _col_sum_ir(module, L, n, fty, ptr):
    """The LLVM function behind :func:`_col_sum_noalias`: ``L`` taps, ``n`` output rows of ``fty`` (``ptr``: the
    pointer type numba gives an array's data), arguments
    ``(blk*, blk row stride, out row 0*, ..., out row n-1*, w*, m)``, every pointer ``noalias``: ``out q [j] =
    sum_k w[k] blk[(k + q) * stride + j]``, one loop over the columns ``j < m`` with the taps unrolled, which
    LLVM vectorises with no alias checks."""
    name = f"splatflow_col_sum_{L}x{n}_{'f32' if isinstance(fty, ir.FloatType) else 'f64'}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    i64 = ir.IntType(64)
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr, i64] + [ptr] * n + [ptr, i64]), name)
    fn.linkage = "internal"
    blk, stride, *outs, w, m = fn.args
    for arg in [blk, w] + outs:
        arg.add_attribute("noalias")
    entry, loop, done = fn.append_basic_block("entry"), fn.append_basic_block("loop"), fn.append_basic_block("done")
    b = ir.IRBuilder(entry)
    taps = [b.load(b.gep(w, [ir.Constant(i64, k)], inbounds=True, source_etype=fty), typ=fty) for k in range(L)]
    rows = [b.gep(blk, [b.mul(stride, ir.Constant(i64, k))], inbounds=True, source_etype=fty)
            for k in range(L + n - 1)]
    b.cbranch(b.icmp_signed(">", m, ir.Constant(i64, 0)), loop, done)
    b = ir.IRBuilder(loop)
    j = b.phi(i64)
    j.add_incoming(ir.Constant(i64, 0), entry)
    vals = [b.load(b.gep(row, [j], inbounds=True, source_etype=fty), typ=fty) for row in rows]
    fast = ("fast",)  # as the numba kernels' fastmath: LLVM may contract to FMAs and vectorise
    for q, out in enumerate(outs):
        acc = b.fmul(taps[0], vals[q], flags=fast)
        for k in range(1, L):
            acc = b.fadd(acc, b.fmul(taps[k], vals[k + q], flags=fast), flags=fast)
        b.store(acc, b.gep(out, [j], inbounds=True, source_etype=fty))
    nxt = b.add(j, ir.Constant(i64, 1), flags=("nsw", "nuw"))
    j.add_incoming(nxt, loop)
    b.cbranch(b.icmp_signed("<", nxt, m), loop, done)
    ir.IRBuilder(done).ret_void()
    return fn


@intrinsic
def _col_sum_noalias(typingctx, blk, out, w, m, L):
    """:func:`_col_sum` for a literal ``L``, as LLVM IR whose pointers are declared ``noalias``
    (:func:`_col_sum_ir`). The same loop in numba compiled to a vectorised loop behind a run-time check of every
    row read against every row written (at 11 taps and four rows, about 230 pointer comparisons: numba cannot say
    that two arrays do not overlap, and the rows' stride is a run-time value). That check cost about 190 ns a
    call, whatever the row's width: 448 against 222 ns a call at W = 490, 230 against 43 ns at W = 16; and the
    SSIM kernel makes nine such calls per four rows. The arrays must be C-contiguous (:func:`_col_sum_ov` checks)
    and ``out`` must not overlap ``blk``: every caller writes into buffers of its own, apart from the ring it
    reads."""
    if not isinstance(L, types.IntegerLiteral):
        return None
    n = 4 if out.ndim == 2 else 1
    sig = types.void(blk, out, w, m, L)

    def codegen(context, builder, sig, args):
        ba = context.make_array(sig.args[0])(context, builder, args[0])
        oa = context.make_array(sig.args[1])(context, builder, args[1])
        wa = context.make_array(sig.args[2])(context, builder, args[2])
        fty = context.get_data_type(sig.args[0].dtype)
        size = context.get_constant(types.intp, context.get_abi_sizeof(fty))
        stride = builder.sdiv(cgutils.unpack_tuple(builder, ba.strides)[0], size)
        outs = [oa.data]
        if n > 1:
            ostride = builder.sdiv(cgutils.unpack_tuple(builder, oa.strides)[0], size)
            outs = [builder.gep(oa.data, [builder.mul(ostride, context.get_constant(types.intp, q))], inbounds=True,
                                source_etype=fty) for q in range(n)]
        cols = context.cast(builder, args[3], sig.args[3], types.intp)
        builder.call(_col_sum_ir(builder.module, L.literal_value, n, fty, ba.data.type),
                     [ba.data, stride] + outs + [wa.data, cols])
        return context.get_dummy_value()

    return sig, codegen


@overload(_col_sum, jit_options={"fastmath": True}, prefer_literal=True)
def _col_sum_ov(blk, out, w, m, L):
    """:func:`_col_sum`: through :func:`_col_sum_noalias` when ``L`` is a literal (the stencils' common tap
    counts, see :func:`_unrolled`) and the arrays are C-contiguous, else a numba loop."""
    if out.ndim == 1:
        def loop(blk, out, w, m, L):
            for j in range(m):
                acc = w[0] * blk[0, j]
                for k in range(1, L):
                    acc += w[k] * blk[k, j]
                out[j] = acc
    else:
        def loop(blk, out, w, m, L):
            for j in range(m):
                a0 = w[0] * blk[0, j]
                a1 = w[0] * blk[1, j]
                a2 = w[0] * blk[2, j]
                a3 = w[0] * blk[3, j]
                for k in range(1, L):
                    a0 += w[k] * blk[k, j]
                    a1 += w[k] * blk[k + 1, j]
                    a2 += w[k] * blk[k + 2, j]
                    a3 += w[k] * blk[k + 3, j]
                out[0, j] = a0
                out[1, j] = a1
                out[2, j] = a2
                out[3, j] = a3
    contiguous = blk.layout == out.layout == w.layout == "C"  # (every caller's rows are; others take the loop)
    if not isinstance(L, types.IntegerLiteral) or not contiguous or not blk.dtype == out.dtype == w.dtype:
        return loop

    def impl(blk, out, w, m, L):
        _col_sum_noalias(blk, out, w, m, L)
    return impl


@nb.njit(cache=True, fastmath=True)
def _vconv(blk, unused, out, w, m, L):
    """Down the rows of a block: ``out[j] = sum_k w[k] blk[k, j]`` for ``j < m`` (:func:`_col_sum`)."""
    _col_sum(blk, out, w, m, L)


@nb.njit(cache=True, fastmath=True)
def _vconv4(blk, unused, out, w, m, L):
    """Four consecutive output rows of the stencil down a block of ``L + 3`` rows: ``out[b, j] = sum_k w[k]
    blk[k + b, j]`` (:func:`_col_sum`). (Pairing the symmetric taps, an add and one multiply-add per pair, was
    measured too: no faster inside the kernels.)"""
    _col_sum(blk, out, w, m, L)


@nb.njit(cache=True, fastmath=True, inline="always")
def _unrolled(conv, a, b, c, d, e, L):
    """``conv(a, b, c, d, e, L)`` with ``L`` a literal for the common tap counts (SSIM: 11; training blur up to
    sigma 2.67 px: 3..17)."""
    if L == 11:
        conv(a, b, c, d, e, 11)
    elif L == 3:
        conv(a, b, c, d, e, 3)
    elif L == 5:
        conv(a, b, c, d, e, 5)
    elif L == 7:
        conv(a, b, c, d, e, 7)
    elif L == 9:
        conv(a, b, c, d, e, 9)
    elif L == 13:
        conv(a, b, c, d, e, 13)
    elif L == 15:
        conv(a, b, c, d, e, 15)
    elif L == 17:
        conv(a, b, c, d, e, 17)
    else:
        conv(a, b, c, d, e, L)


@nb.njit(cache=True, fastmath=True, inline="always")
def _unrolled11(conv, a, b, c, d, e, L):
    """:func:`_unrolled` for the SSIM window: 11 taps as a literal, anything else as it comes. The SSIM kernel's
    many stencil call sites each expanded :func:`_unrolled`'s nine variants, which tripled its compile time."""
    if L == 11:
        conv(a, b, c, d, e, 11)
    else:
        conv(a, b, c, d, e, L)


@nb.njit(cache=True, fastmath=True)
def _h5(inp, out, w, m, unused, L):
    """Along a row: ``out[j] = sum_k w[k] inp[j + k]`` for ``j < m``. (Unlike the column stencil's, this loop's
    alias checks are cheap: through :func:`_col_sum_noalias`'s way it was no faster, and the transposed blur
    slower.)"""
    for j in range(m):
        acc = w[0] * inp[j]
        for k in range(1, L):
            acc += w[k] * inp[j + k]
        out[j] = acc


@nb.njit(cache=True, fastmath=True)
def _h5dup(inp, out, w, m, out2, L):
    """:func:`_h5` writing each result to ``out`` and ``out2`` (a ring row and its second copy)."""
    for j in range(m):
        acc = w[0] * inp[j]
        for k in range(1, L):
            acc += w[k] * inp[j + k]
        out[j] = acc
        out2[j] = acc


@nb.njit(cache=True, fastmath=True, inline="always")
def _ring_stencil(pad, ring, slot, taps, m):
    """:func:`_row_stencil` into ring row ``slot`` and its second copy ``R`` slots further (see
    :func:`_col_stencil`) in one pass, instead of the stencil then :func:`_ring_dup`."""
    _unrolled(_h5dup, pad, ring[slot], taps, m, ring[slot + ring.shape[0] // 2], taps.shape[0])


@nb.njit(cache=True, fastmath=True, inline="always")
def _ring_stencil11(pad, ring, slot, taps, m):
    """:func:`_ring_stencil` through :func:`_unrolled11` (the SSIM window)."""
    _unrolled11(_h5dup, pad, ring[slot], taps, m, ring[slot + ring.shape[0] // 2], taps.shape[0])


@nb.njit(cache=True, fastmath=True, inline="always")
def _row_stencil(pad, out, taps, m):
    """``out[j] = sum_k taps[k] pad[j + k]`` for ``j < m``."""
    _unrolled(_h5, pad, out, taps, m, 0, taps.shape[0])


@nb.njit(cache=True, fastmath=True, inline="always")
def _col_stencil(ring, row0, out, band, start, i):
    """Row ``i`` of ``M @ rows`` from a ring of ``2 R`` rows (``R >= L``) where row ``q`` sits at
    ``(q - row0) % R`` and again ``R`` slots further (see :func:`_ring_dup`), so any ``L`` consecutive rows are
    one contiguous block: with a ring indexed modulo ``R`` inside the loop LLVM did not vectorise (the ``L``
    separate row pointers exceed its runtime alias checks; 45x slower)."""
    L = band.shape[1]
    b = (start[i] - row0) % (ring.shape[0] // 2)
    _unrolled(_vconv, ring[b:b + L], 0, out, band[i], out.shape[0], L)


@nb.njit(cache=True, fastmath=True, inline="always")
def _col_stencil11(ring, row0, out, band, start, i):
    """:func:`_col_stencil` through :func:`_unrolled11` (the SSIM window)."""
    L = band.shape[1]
    b = (start[i] - row0) % (ring.shape[0] // 2)
    _unrolled11(_vconv, ring[b:b + L], 0, out, band[i], out.shape[0], L)


@nb.njit(cache=True, fastmath=True, inline="always")
def _col_stencil4_11(ring, row0, out, band, start, i):
    """:func:`_col_stencil4` through :func:`_unrolled11` (the SSIM window)."""
    L = band.shape[1]
    b = (start[i] - row0) % (ring.shape[0] // 2)
    _unrolled11(_vconv4, ring[b:b + L + 3], 0, out, band[i], out.shape[1], L)


@nb.njit(cache=True, fastmath=True, inline="always")
def _col_stencil4(ring, row0, out, band, start, i):
    """Rows ``i .. i + 3`` of ``M @ rows`` into ``out [4, W]`` (as :func:`_col_stencil`), for four plain rows
    (``band[i + b] == band[i]``, ``start[i + b] == start[i] + b``): the ring must hold ``L + 3`` rows."""
    L = band.shape[1]
    b = (start[i] - row0) % (ring.shape[0] // 2)
    _unrolled(_vconv4, ring[b:b + L + 3], 0, out, band[i], out.shape[1], L)


@nb.njit(cache=True, fastmath=True, inline="always")
def _ring_dup(ring, slot):
    """Copy ring row ``slot < R`` to ``slot + R`` (the second copy of :func:`_col_stencil`'s ring)."""
    a = ring[slot]
    b = ring[slot + ring.shape[0] // 2]
    for j in range(a.shape[0]):
        b[j] = a[j]


# -- row filters with padding -----------------------------------------------------------------------------------

@nb.njit(cache=True, fastmath=True, inline="always")
def _pad_buffer(W, r, mode, dtype_like):
    """A zeroed padded-row buffer for :func:`_row_filter` (and its scratch row for the transpose)."""
    if mode == REFLECT_T:
        return np.zeros(W + 4 * r, dtype=dtype_like.dtype), np.empty(W + 2 * r, dtype=dtype_like.dtype)
    return np.zeros(W + 2 * r, dtype=dtype_like.dtype), np.empty(0, dtype=dtype_like.dtype)


@nb.njit(cache=True, fastmath=True, inline="always")
def _fill_pad(src, pad, r, reflect):
    """The row ``src`` into the middle of ``pad`` (``r`` either side), the borders mirrored with ``reflect``
    (else left zero)."""
    W = src.shape[0]
    mid = pad[r:r + W]  # a slice, not an offset index: see the stencils' note on indices
    for j in range(W):
        mid[j] = src[j]
    if reflect:
        for q in range(1, r + 1):
            pad[r - q] = src[q]
            pad[r + W - 1 + q] = src[W - 1 - q]


@nb.njit(cache=True, fastmath=True, inline="always")
def _row_filter_reflect(src, ring, slot, taps, pad):
    """:func:`_row_filter` with reflect padding only (the SSIM kernel's blur: one stencil call site less)."""
    _fill_pad(src, pad, (taps.shape[0] - 1) // 2, True)
    _ring_stencil(pad, ring, slot, taps, src.shape[0])


@nb.njit(cache=True, fastmath=True, inline="always")
def _row_filter(src, ring, slot, taps, mode, pad, tmp):
    """Ring row ``slot`` (and its second copy, see :func:`_col_stencil`) = the filter ``taps`` (length
    ``2r + 1``) along the row ``src`` (length ``W``) with padding ``mode``; ``pad`` and ``tmp`` from
    :func:`_pad_buffer` (their zero borders are never written)."""
    W = src.shape[0]
    r = (taps.shape[0] - 1) // 2
    if mode == REFLECT_T:
        # adjoint of "reflect-pad, then stencil": the (reversed) stencil over the row zero-padded by 2r gives
        # the gradient of every padded position, then the mirrored ones are added back to their pixels
        dst = ring[slot]
        _fill_pad(src, pad, 2 * r, False)
        _row_stencil(pad, tmp, taps, W + 2 * r)
        inner = tmp[r:r + W]
        for j in range(W):
            dst[j] = inner[j]
        for q in range(1, r + 1):
            dst[q] += tmp[r - q]
            dst[W - 1 - q] += tmp[r + W - 1 + q]
        _ring_dup(ring, slot)
        return
    _fill_pad(src, pad, r, mode == REFLECT)
    _ring_stencil(pad, ring, slot, taps, W)


# -- SSIM -------------------------------------------------------------------------------------------------------

@nb.njit(parallel=True, cache=True, fastmath=True)
def ssim_fused(x, y, taps, bh, sh, lo, hi, btaps, bbh, bsh, blo, bhi, want_x, want_y, want_sign, segs, first):
    """SSIM of two ``[P, H, W]`` stacks, and the gradients of the SUM of its map w.r.t. ``x`` / ``y`` (those
    wanted), with the separable window ``taps`` along the rows (zero padding) x the band ``(bh, sh)`` down the
    columns, whose rows ``lo <= i < hi`` are the plain stencil.

    Returns ``(row_sums [P * H] float64, l1_rows [P * H] float64, gx, gy, sgn)``: per-row sums of the SSIM map
    and of ``|x - y|`` (the L1 term of the training loss, for free while the rows are in cache), the gradients
    and, with ``want_sign``, ``sign(x - y)`` as int8 (the L1 term's gradient for :func:`add_sign_grad` and
    :func:`separable_filter`, 1 byte a pixel instead of both images read again); each empty when not wanted.
    ``x`` and ``y`` may be strided views (the ``[C, H, W]`` view of an ``[H, W, C]`` image).

    With blur taps ``btaps`` (no taps: none) and their band ``(bbh, bsh)`` (plain rows ``blo <= i < bhi``), all
    of this is of ``x`` and ``y`` blurred by that filter with reflect padding (the training blur, as
    :func:`separable_filter`), made row by row on the way in: the blurred images never go through memory.

    With ``S`` the map and ``G`` the window filter, the moments are ``G x``, ``G y``, ``G (x^2 + y^2)`` and
    ``G (x y)``: ``E[x^2]`` and ``E[y^2]`` enter SSIM only through their sum (the sum of the variances), so four
    filtered moments instead of five. ``d sum(S) / dx = G^T dmu_x + 2 x G^T dE + y G^T dE[xy]`` with
    ``dE = dS/dE[x^2 + y^2]`` (symmetrically for y); the zero-padded symmetric window is its own transpose, so
    the same filter takes the point-wise derivatives.

    Work is split into segments ``segs [S, 3]`` (plane, first row, end row) run in parallel, the segments of
    item ``t`` being ``segs[first[t]:first[t + 1]]`` (:func:`splatflow.render.filters.row_segments`: all rows of
    all planes cut into one run per thread, so that a plane is cut only where a thread's share ends: the rows
    in the filters' reach of a cut are made by both sides; the results do not depend on the cuts). A segment
    streams its rows through rings (see the module docstring): the input rows (blurred, or copied from a
    strided view), with the blur ``x`` and ``y`` blurred along the rows, the row-filtered moments, and the
    row-filtered derivative maps. Output rows go in batches of ``BATCH_ROWS``, one moment (or derivative map)
    at a time over the batch, so the ring rows that the batch's column stencils share stay in L1 cache (25-30%
    faster than all five moments row by row). Each SSIM row is made as soon as its moment rows are in, each
    gradient row as soon as its derivative rows are in; nothing else is written to memory.
    """
    P, H, W = x.shape
    L = bh.shape[1]
    r = (taps.shape[0] - 1) // 2
    B = BATCH_ROWS
    R = L + B - 1  # ring rows: the reach of one batch
    C1 = 0.01 ** 2
    C2 = 0.03 ** 2
    two = _typed(2.0, x)  # typed constants: the point-wise terms and gradient rows stay in the storage type
    one = _typed(1.0, x)
    c1 = _typed(C1, x)
    c2 = _typed(C2, x)
    need = want_x or want_y
    blur = btaps.shape[0] > 0
    Lb = bbh.shape[1]
    rb = (btaps.shape[0] - 1) // 2 if blur else 0
    Rb = Lb + B - 1  # blur ring rows: the reach of one batch
    # ring of input rows (blurred, or copied from a strided view): from the oldest gradient row still to come to
    # the newest moment row, at most 2 r + 2 B apart, in whole batches (slots of a batch are consecutive)
    RG = 2 * L + 8 * B
    RG -= RG % B
    row_sums = np.zeros(P * H, dtype=np.float64)
    l1_rows = np.zeros(P * H, dtype=np.float64)
    gx = np.empty((P, H, W) if want_x else (0, 0, 0), dtype=x.dtype)
    gy = np.empty((P, H, W) if want_y else (0, 0, 0), dtype=x.dtype)
    sgn = np.empty((P, H, W) if want_sign else (0, 0, 0), dtype=np.int8)
    for t in nb.prange(first.shape[0] - 1):
        hm = np.empty((4, 2 * R, W), dtype=x.dtype)  # ring: row-filtered x, y, x^2 + y^2, xy
        dh = np.empty((4, 2 * R if need else 0, W), dtype=x.dtype)  # ring: the row-filtered derivative maps
        src = np.zeros((4, W + 2 * r), dtype=x.dtype)  # zero-padded rows: x, y, x^2 + y^2, xy; then the dm
        # their insides as slices (an offset index would cost the vectorisation, see the stencils' note)
        s0, s1, s2, s3 = src[0, r:r + W], src[1, r:r + W], src[2, r:r + W], src[3, r:r + W]
        mom = np.empty((4, B, W), dtype=x.dtype)
        acc = np.empty((4, B, W), dtype=x.dtype)
        xin = np.empty((RG, W), dtype=x.dtype)  # input rows: row q at slot (q - m0) % RG
        yin = np.empty((RG, W), dtype=x.dtype)
        bx = np.empty((2 * Rb if blur else 0, W), dtype=x.dtype)  # blur rings: x, y blurred along the rows
        by = np.empty((2 * Rb if blur else 0, W), dtype=x.dtype)
        padb, _ = _pad_buffer(W, rb, REFLECT, x)
        for sg in range(first[t], first[t + 1]):
            p = segs[sg, 0]
            r0 = segs[sg, 1]
            r1 = segs[sg, 2]
            d0, d1 = r0, r1  # rows whose point-wise terms are needed
            if need:
                d0, d1 = sh[r0], sh[r1 - 1] + L
            m0 = sh[d0]  # first row whose moments are needed
            bm0 = bsh[m0] if blur else 0
            bnm = bm0  # next input row to blur along x
            nin = m0  # next input row to make
            nm = m0  # next row to filter along x
            ni = r0  # next gradient row
            for d in range(d0, d1, B):
                e = min(d + B, d1)
                while nm < sh[e - 1] + L:  # the batch's moment rows in: filter row nm along x into the ring
                    if nin <= nm:  # the next batch of input rows: the blur's column stencil, or a copy
                        q1 = min(nin + B, H)
                        sl = (nin - m0) % RG
                        if blur:
                            # (x and y through one call site of each stencil: each site is compiled code)
                            while bnm < bsh[q1 - 1] + Lb:
                                k = (bnm - bm0) % Rb
                                for im in range(2):
                                    _row_filter_reflect(x[p, bnm] if im == 0 else y[p, bnm], bx if im == 0 else by,
                                                        k, btaps, padb)
                                bnm += 1
                            for im in range(2):
                                ring_b = bx if im == 0 else by
                                dst_b = xin if im == 0 else yin
                                if q1 - nin == B and blo <= nin and q1 <= bhi:
                                    _col_stencil4(ring_b, bm0, dst_b[sl:sl + B], bbh, bsh, nin)
                                else:
                                    for b in range(q1 - nin):
                                        _col_stencil(ring_b, bm0, dst_b[sl + b], bbh, bsh, nin + b)
                        else:
                            for b in range(q1 - nin):
                                xs, ys, xd, yd = x[p, nin + b], y[p, nin + b], xin[sl + b], yin[sl + b]
                                for j in range(W):
                                    xd[j] = xs[j]
                                    yd[j] = ys[j]
                        nin = q1
                    xr = xin[(nm - m0) % RG]
                    yr = yin[(nm - m0) % RG]
                    a = 0.0
                    for j in range(W):
                        u = xr[j]
                        v = yr[j]
                        a += abs(u - v)
                        s0[j] = u
                        s1[j] = v
                        s2[j] = u * u + v * v
                        s3[j] = u * v
                    if r0 <= nm < r1:
                        l1_rows[p * H + nm] = a
                        if want_sign:  # sign(x - y) of the chunk's own rows: the L1 term's gradient, 1 byte a pixel
                            sr = sgn[p, nm]
                            for j in range(W):
                                dv = xr[j] - yr[j]
                                sr[j] = (dv > 0) - (dv < 0)
                    q = (nm - m0) % R
                    for c in range(4):
                        _ring_stencil11(src[c], hm[c], q, taps, W)
                    nm += 1
                plain = e - d == B and lo <= d and e <= hi
                for c in range(4):
                    if plain:
                        _col_stencil4_11(hm[c], m0, mom[c], bh, sh, d)
                    else:
                        for b in range(e - d):
                            _col_stencil11(hm[c], m0, mom[c, b], bh, sh, d + b)
                for b in range(e - d):
                    dd = d + b
                    total = 0.0
                    mx_, my_, mss, mxy_ = mom[0, b], mom[1, b], mom[2, b], mom[3, b]
                    for j in range(W):
                        # in the storage type, as the moments themselves (their float32 rounding, not this
                        # arithmetic's, bounds the variances' error): SSIM(x, x) is 1 within 3e-6 in float32
                        mx = mx_[j]
                        my = my_[j]
                        mxy = mx * my
                        a1 = two * mxy + c1
                        a2 = two * (mxy_[j] - mxy) + c2
                        b1 = mx * mx + my * my + c1
                        b2 = mss[j] - (mx * mx + my * my) + c2
                        inv_d = one / (b1 * b2)  # one division: 1/b1 and 1/b2 follow from it
                        sv = a1 * a2 * inv_d
                        total += sv
                        if need:
                            s_b2 = sv * b1 * inv_d  # S / B2
                            diff = s_b2 - sv * b2 * inv_d  # S / B2 - S / B1
                            qq = two * (a2 - a1) * inv_d
                            s0[j] = qq * my + two * mx * diff  # dS/dmu_x
                            s1[j] = qq * mx + two * my * diff  # dS/dmu_y
                            s2[j] = -s_b2  # dS/dE[x^2 + y^2]
                            s3[j] = two * a1 * inv_d  # dS/dE[xy]
                    if r0 <= dd < r1:
                        row_sums[p * H + dd] = total
                    if not need:
                        continue
                    q = (dd - d0) % R
                    for c in range(4):
                        if (c != 0 or want_x) and (c != 1 or want_y):
                            _ring_stencil11(src[c], dh[c], q, taps, W)
                    while ni < r1:  # the next batch of gradient rows, once its derivative rows are in
                        f = min(ni + B, r1)
                        if sh[f - 1] + L - 1 > dd:
                            break
                        for c in range(4):
                            if (c != 0 or want_x) and (c != 1 or want_y):
                                if f - ni == B and lo <= ni and f <= hi:
                                    _col_stencil4_11(dh[c], d0, acc[c], bh, sh, ni)
                                else:
                                    for i in range(ni, f):
                                        _col_stencil11(dh[c], d0, acc[c, i - ni], bh, sh, i)
                        for i in range(ni, f):
                            xr = xin[(i - m0) % RG]
                            yr = yin[(i - m0) % RG]
                            a0, a2_, a3 = acc[0, i - ni], acc[2, i - ni], acc[3, i - ni]
                            if want_x:
                                o = gx[p, i]
                                for j in range(W):
                                    o[j] = a0[j] + two * xr[j] * a2_[j] + yr[j] * a3[j]
                            if want_y:
                                a1_ = acc[1, i - ni]
                                o = gy[p, i]
                                for j in range(W):
                                    o[j] = a1_[j] + two * yr[j] * a2_[j] + xr[j] * a3[j]
                        ni = f
    return row_sums, l1_rows, gx, gy, sgn


@nb.njit(parallel=True, cache=True, fastmath=True)
def add_sign_grad(g, sgn, a, b, hwc_out):
    """``a * g + b * sgn`` of ``[P, H, W]`` planes (``g`` with no planes means 0; ``sgn`` the int8 sign map of
    :func:`ssim_fused`): the SSIM gradient scaled by its incoming gradient plus the L1 term's, in one pass; laid
    out ``[H, W, P]`` with ``hwc_out`` (the layout of the render whose gradient it is)."""
    P, H, W = sgn.shape
    has_g = g.shape[0] == P
    ta = _typed(a, g)
    tb = _typed(b, g)
    out = np.empty((0 if hwc_out else P, H, W), dtype=g.dtype)
    outh = np.empty((H, W, P) if hwc_out else (0, 0, 0), dtype=g.dtype)
    for i in nb.prange(H):
        row = np.empty(W if hwc_out else 0, dtype=g.dtype)
        for p in range(P):
            o = row if hwc_out else out[p, i]
            sr = sgn[p, i]
            if has_g:
                gr = g[p, i]
                for j in range(W):
                    o[j] = ta * gr[j] + tb * sr[j]
            else:
                for j in range(W):
                    o[j] = tb * sr[j]
            if hwc_out:
                oh = outh[i]
                for j in range(W):
                    oh[j, p] = row[j]
    return outh if hwc_out else out


# -- the training blur ------------------------------------------------------------------------------------------

@nb.njit(parallel=True, cache=True, fastmath=True)
def separable_filter(src, src2, taps, mode, bh, sh, lo, hi, chunk, sgn, a, b, hwc_out=False):
    """``out[p] = Mh @ src[p] @ Mw^T`` for every plane of ``src [P, H, W]`` and of ``src2 [P2, H, W]`` (may
    have no planes): the row filter ``taps`` with padding ``mode`` (``REFLECT``, or ``REFLECT_T`` with the taps
    reversed for the transpose), then the band ``(bh, sh)`` down each column (its rows ``lo <= i < hi`` the plain
    stencil, taken four at a time by :func:`_col_stencil4`). With the transposed band and
    ``REFLECT_T`` this is the backward of the same filter (the two axes commute). Returns ``(out, out2)``.

    When ``sgn`` has planes (int8, shaped as ``src``), ``src`` stands for ``a * src + b * sgn``, formed row by
    row as it is read: with ``src`` and ``sgn`` from :func:`ssim_fused`, the gradient of ``a * sum(SSIM map) +
    b * sum|xb - yb|`` of the blurred images on its way back through the blur, without that image going through
    memory.

    ``src`` and ``src2`` may be strided views, e.g. the ``[C, H, W]`` view of an ``[H, W, C]`` image: a row is
    read once, into the padded row buffer, so the layout costs a gathered copy of the row and no copy of the
    image. With ``hwc_out`` the first result is laid out ``[H, W, P]`` (each output row goes through a
    contiguous row, then into its channel), the layout of the render whose gradient it is.

    One parallel loop over chunks of ``chunk`` rows of a plane of either stack (render and target go through one
    loop, so the threads meet once per call: on a shared machine every parallel loop waits for its slowest
    thread); each chunk streams its rows through a ring of ``L + 3`` row-filtered rows."""
    P, H, W = src.shape
    P2 = src2.shape[0]
    L = bh.shape[1]
    r = (taps.shape[0] - 1) // 2
    B = BATCH_ROWS
    R = L + B - 1  # ring rows: the reach of one batch of output rows
    nc = (H + chunk - 1) // chunk
    combine = sgn.shape[0] > 0
    ta = _typed(a, src)  # typed: the rows stay in the storage type
    tb = _typed(b, src)
    out = np.empty((0 if hwc_out else P, H, W), dtype=src.dtype)
    outh = np.empty((H, W, P) if hwc_out else (0, 0, 0), dtype=src.dtype)
    out2 = np.empty((P2, H, W), dtype=src.dtype)
    for t in nb.prange((P + P2) * nc):
        q = t // nc
        r0 = (t - q * nc) * chunk
        r1 = min(H, r0 + chunk)
        own = q < P
        to_hwc = own and hwc_out
        img = src[q] if own else src2[q - P]
        m0 = sh[r0]
        ring = np.empty((2 * R, W), dtype=src.dtype)
        pad, tmp = _pad_buffer(W, r, mode, src)
        row = np.empty(W if combine else 0, dtype=src.dtype)
        orow = np.empty((B, W) if to_hwc else (0, 0), dtype=src.dtype)
        nm = m0
        for i in range(r0, r1, B):
            e = min(i + B, r1)
            while nm < sh[e - 1] + L:  # the batch's input rows in: filter row nm along x into the ring
                k = (nm - m0) % R
                if combine and own:
                    g, sr = img[nm], sgn[q, nm]
                    for j in range(W):
                        row[j] = ta * g[j] + tb * sr[j]
                    _row_filter(row, ring, k, taps, mode, pad, tmp)
                else:
                    _row_filter(img[nm], ring, k, taps, mode, pad, tmp)
                nm += 1
            if to_hwc:
                dst = orow[:e - i]
            elif own:
                dst = out[q, i:e]
            else:
                dst = out2[q - P, i:e]
            if e - i == B and lo <= i and e <= hi:
                _col_stencil4(ring, m0, dst, bh, sh, i)
            else:
                for b in range(e - i):
                    _col_stencil(ring, m0, dst[b], bh, sh, i + b)
            if to_hwc:
                for b in range(e - i):
                    dh = outh[i + b]
                    ob = orow[b]
                    for j in range(W):
                        dh[j, q] = ob[j]
    return (outh if hwc_out else out), out2
