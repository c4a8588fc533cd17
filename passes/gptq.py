"""GPTQ: round a weight onto a format's grids column by column, pushing each column's rounding
error onto the columns not yet rounded through the inverse of the input second-moment matrix.

Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers" (2023), Algorithm 1: with H = E[x x^T] + damping and U the upper Cholesky factor
of H^-1, rounding column j to q_j and updating W[:, j+1:] -= (w_j - q_j) / U_jj * U[j, j+1:]
minimises the layer's output error E||(W - Q) x||^2 one column at a time. Updates are applied
lazily, a block of columns at a time (the paper's "lazy batch"), so the work is a few matrix
products per block instead of a rank-1 update per column.

Every format is driven through its `GridQuantizer` (ir/formats/base.py): `start` once, `fit` at
the first column of each group on the weights as updated so far (weighted by diag(H)),
`project` per column, `pack` at the end. The blob is therefore one that the format's `decode`
reads, and nothing here knows a format.

`act_order` visits columns by decreasing diag(H) (the paper's heuristic for the columns that
matter most); grids are then fitted up front on the original weights ("static groups"), since a
group's columns are no longer visited together.

A quantizer that codes a block of columns jointly (`joint`, the trellis format: its fit is the coded
block and its projection of a column is that block's column) turns the sweep into BlockLDLQ (QuIP#,
QTIP): each block is coded from the weights as the blocks before it left them, and the column updates
inside it add up to W[:, rest] -= (W_J - Q_J) U_JJ^-1 U_J,rest. Its blocks are coded for all the
weights of a batched sweep in one fit (each row under its own weight's importance), and act_order
(which would scatter a block's columns) is refused.
"""

from __future__ import annotations

DAMP = 0.01  # damping added to diag(H), as a share of its mean (the paper's 1%)
BLOCK = 128  # columns per lazy update; a multiple of every group size the formats allow


def inverse_cholesky(hessian, damp: float = DAMP):
    """U, the upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, and the damped H.
    Channels no calibration token used (H_jj == 0) get H_jj = 1, so the factor exists; the damping
    grows tenfold until the factorisation succeeds."""
    import torch

    h = hessian.double().clone()
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0
    mean = float(torch.diagonal(h).mean())
    for attempt in range(6):
        damped = h + (damp * 10**attempt) * mean * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
        lower, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper.float(), damped.float()
    raise ValueError("the input second-moment matrix is not positive definite even with heavy damping")


def gptq(weight, hessian, fmt, params=(), *, act_order: bool = False, damp: float = DAMP, block: int = BLOCK,
         factor=None):
    """(blob, w_hat): `weight` [rows, cols] quantized to `fmt` with GPTQ under `hessian` [cols, cols]
    (E[x x^T] of the weight's input); w_hat is what the blob decodes to (float32). `factor`, when
    given, is inverse_cholesky(hessian, damp) computed earlier (a caller rounding one weight to
    several formats factors its matrix once); act_order permutes the matrix, so it factors its own."""
    import torch

    w = weight.detach().float().clone()
    rows, cols = w.shape
    q = fmt.quantizer((rows, cols), params)
    hessian = hessian.to(w.device).float()
    if q.block != cols and (q.block > block or block % q.block):
        raise ValueError(f"format {fmt.name}: groups of {q.block} columns do not tile GPTQ blocks of {block}")
    if act_order and getattr(q, "joint", False):
        raise ValueError(f"format {fmt.name} codes blocks of {q.block} columns jointly: act_order does not apply")
    q.start(w)
    if act_order:
        order = torch.argsort(torch.diagonal(hessian), descending=True, stable=True)
        upper, damped = inverse_cholesky(hessian[order][:, order], damp)
        importance = torch.diagonal(damped)[torch.argsort(order)]  # back in column order
        # Static groups: every grid from the original weights, before any column moves.
        static = [q.fit(w[:, c:c + q.block], importance[c:c + q.block]) for c in range(0, cols, q.block)]
        w_hat = _sweep(w[:, order], upper, lambda j, work, jj, rest: (static[int(order[j]) // q.block],
                                                                        int(order[j]) % q.block), q, block)
        return q.pack(w_hat[:, torch.argsort(order)], static), w_hat[:, torch.argsort(order)]
    upper, damped = factor if factor is not None else inverse_cholesky(hessian, damp)
    upper, importance = upper.to(w.device), torch.diagonal(damped).to(w.device)
    grids: list = []

    def grid_for(col, work, j, rest):
        if col % q.block == 0:
            # The group's columns are current: earlier blocks were flushed into `rest`, and this
            # block's updates so far are in `work`.
            span = work[:, j:j + q.block] if j + q.block <= work.shape[1] else rest[:, col:col + q.block]
            grids.append(q.fit(span, importance[col:col + q.block]))
        return grids[-1], col % q.block

    # A per-row grid (block == cols) is fitted once, on the untouched weight, at column 0.
    w_hat = _sweep(w, upper, grid_for, q, block)
    return q.pack(w_hat, grids), w_hat


def gptq_many(weights: list, hessians: list, fmt, params=(), *, damp: float = DAMP, block: int = BLOCK,
              factors: list | None = None):
    """(blob, w_hat) of the weights [rows, cols] (all one shape) stacked along the rows, each
    quantized to `fmt` by GPTQ under its own `hessians` entry: what gptq() gives each alone, up to
    the summation order of the batched products, in one column sweep instead of one per weight
    (on a GPU the sweep's cost is launches per column, not arithmetic). `factors`: each hessian's
    inverse_cholesky, when the caller has them."""
    import torch

    w = torch.stack([x.detach().float() for x in weights])  # [B, rows, cols]
    count, rows, cols = w.shape
    q = fmt.quantizer((count * rows, cols), params)
    if q.block != cols and (q.block > block or block % q.block):
        raise ValueError(f"format {fmt.name}: groups of {q.block} columns do not tile GPTQ blocks of {block}")
    q.start(w.reshape(count * rows, cols))
    # Grids are fitted per weight, each by its own quantizer under its own importance (the numbers
    # gptq() gives it alone: a per-row importance would sum the same terms in another order).
    alone = [fmt.quantizer((rows, cols), params) for _ in range(count)]
    for qb, wb in zip(alone, w):
        qb.start(wb)
    factors = factors or [inverse_cholesky(h.to(w.device).float(), damp) for h in hessians]
    upper = torch.stack([u.to(w.device) for u, _ in factors])  # [B, cols, cols]
    # diag(H) views as gptq() takes them: a reduction's order (its last bits) follows the strides
    importance = [torch.diagonal(d.to(w.device)) for _, d in factors]
    del factors
    grids: list = []

    def grid_for(col, work, j, rest):
        if col % q.block == 0:  # as in gptq(), on each weight's current columns
            span = work[:, :, j:j + q.block] if j + q.block <= work.shape[2] else rest[:, :, col:col + q.block]
            if getattr(q, "joint", False):  # rows coded apart: one fit codes every weight's block
                imp = torch.stack([d[col:col + q.block] for d in importance])  # [B, block]
                grids.append(q.fit(span.reshape(count * rows, q.block),
                                   imp.unsqueeze(1).expand(count, rows, q.block).reshape(count * rows, q.block)))
                return grids[-1], col % q.block
            fitted = [qb.fit(span[b], importance[b][col:col + q.block]) for b, qb in enumerate(alone)]
            grids.append({k: torch.cat([g[k] for g in fitted]) for k in fitted[0]})
        return grids[-1], col % q.block

    w_hat = _sweep(w, upper, grid_for, q, block)
    w_hat = w_hat.reshape(count * rows, cols)
    return q.pack(w_hat, grids), w_hat


def _sweep(w, upper, grid_for, q, block: int):
    """The GPTQ column loop over w (modified in place) with lazy block updates; grid_for(col, work,
    j, w) -> (grid, offset) gives each column's grid. Returns the projected weights. w [rows, cols]
    with upper [cols, cols], or a batch w [B, rows, cols] with upper [B, cols, cols] (gptq_many),
    whose grids cover the B * rows rows in order."""
    import torch

    cols = w.shape[-1]
    w_hat = torch.zeros_like(w)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        work = w[..., i1:i2].clone()
        errors = torch.zeros_like(work)
        u = upper[..., i1:i2, i1:i2]
        for j in range(i2 - i1):
            grid, offset = grid_for(i1 + j, work, j, w)
            column = work[..., j:j + 1]
            projected = q.project(column.reshape(-1, 1), grid, offset).reshape(column.shape)
            w_hat[..., i1 + j:i1 + j + 1] = projected
            err = (column - projected) / u[..., j:j + 1, j:j + 1]
            work[..., j + 1:] -= err * u[..., j:j + 1, j + 1:]
            errors[..., j:j + 1] = err
        w[..., i2:] -= errors @ upper[..., i1:i2, i2:]
    return w_hat


def output_error(w, w_hat, hessian) -> float:
    """E||(W - W_hat) x||^2 summed over output rows: trace((W - W_hat) H (W - W_hat)^T)."""
    delta = (w.float() - w_hat.float())
    return float(((delta @ hessian.float()) * delta).sum())
