"""Adam for all six parameter groups in one GPU launch (a Triton kernel), the optimizers' state left as torch's.

Why: on a GPU the training step is launch-bound (docs/backends.md, "What is left on the GPU path"): torch's fused
Adam is one launch per optimizer, six per step, and it was the largest GPU item of a profiled step. The groups have
different learning rates, and torch's multi-tensor Adam (``_fused_adam_``, ``_foreach_*``) takes one learning rate
per call, so no torch call steps them together. The kernel here reads every group's parameter, gradient and
moments through its own pointers, picks the group by the block it runs, and applies torch's Adam update with
that group's rate; a second launch (one ``_foreach_add_``) advances the six step counts.

What stays as it was: the six ``torch.optim.Adam`` objects (gsplat's strategies rewrite their state rows when
Gaussians are added or removed) and their ``state_dict`` layout (``step`` a float32 tensor on the device,
``exp_avg``, ``exp_avg_sq``), so checkpoints written by either path load in the other. A step skipped by
``found_inf`` (a non-finite loss, the deferred checks of a GPU run) leaves parameters, moments and step counts
untouched, as torch's fused Adam does. The CPU path never uses this: it keeps torch's fused Adam, bit for bit.

The kernel runs compiled on CUDA; under ``TRITON_INTERPRET=1`` Triton runs it on CPU tensors, which is how the
tests compare it with ``torch.optim.Adam`` without a GPU.
"""

from __future__ import annotations

import torch

from splatflow.render.triton_gate import enabled as available  # noqa: F401 (this module's gate)
from splatflow.render.triton_gate import tl, triton

GROUPS = 6  # the kernel's fixed number of groups (the model's six tensors; fewer are padded with empty ones)
BLOCK = 1024
_ZERO: dict = {}  # a zero found_inf flag per device, for steps without deferred checks
_BETAS: dict = {}  # (device, beta1, beta2) -> the betas as float64 on the device


if triton is not None:
    @triton.jit
    def _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, s_ptr, n, lr, blk, beta2, omb1, omb2, eps, betas_ptr,
                    BLOCK: tl.constexpr):
        """torch's Adam (``_fused_adam_``, no weight decay, no amsgrad) on one block of one group. As torch, the
        bias corrections are taken in float64 from the float64 betas (``betas_ptr``: beta2 = 0.999 in float32
        would move ``1 - beta2**step`` by 1e-5 of itself), and ``1 - beta`` comes from the host's float64."""
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        step = tl.load(s_ptr).to(tl.float64) + 1.0
        b1 = tl.load(betas_ptr)
        b2 = tl.load(betas_ptr + 1)
        bc1 = 1.0 - tl.exp2(step * tl.log2(b1))
        bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(b2)))
        step_size = (lr / bc1).to(tl.float32)
        bc2s = bc2_sqrt.to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = m + omb1 * (g - m)  # lerp, as torch
        v = beta2 * v + omb2 * g * g
        denom = tl.sqrt(v) / bc2s + eps
        p = p - step_size * (m / denom)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(p_ptr + offs, p, mask=mask)

    @triton.jit(do_not_specialize=["n0", "n1", "n2", "n3", "n4", "n5"])
    def _multi_adam_kernel(p0, g0, m0, v0, s0, n0, lr0, p1, g1, m1, v1, s1, n1, lr1,
                           p2, g2, m2, v2, s2, n2, lr2, p3, g3, m3, v3, s3, n3, lr3,
                           p4, g4, m4, v4, s4, n4, lr4, p5, g5, m5, v5, s5, n5, lr5,
                           found_inf_ptr, beta2, omb1, omb2, eps, betas_ptr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        if tl.load(found_inf_ptr) == 0.0:
            e0 = tl.cdiv(n0, BLOCK)
            e1 = e0 + tl.cdiv(n1, BLOCK)
            e2 = e1 + tl.cdiv(n2, BLOCK)
            e3 = e2 + tl.cdiv(n3, BLOCK)
            e4 = e3 + tl.cdiv(n4, BLOCK)
            if pid < e0:
                _adam_block(p0, g0, m0, v0, s0, n0, lr0, pid, beta2, omb1, omb2, eps, betas_ptr, BLOCK)
            elif pid < e1:
                _adam_block(p1, g1, m1, v1, s1, n1, lr1, pid - e0, beta2, omb1, omb2, eps, betas_ptr, BLOCK)
            elif pid < e2:
                _adam_block(p2, g2, m2, v2, s2, n2, lr2, pid - e1, beta2, omb1, omb2, eps, betas_ptr, BLOCK)
            elif pid < e3:
                _adam_block(p3, g3, m3, v3, s3, n3, lr3, pid - e2, beta2, omb1, omb2, eps, betas_ptr, BLOCK)
            elif pid < e4:
                _adam_block(p4, g4, m4, v4, s4, n4, lr4, pid - e3, beta2, omb1, omb2, eps, betas_ptr, BLOCK)
            else:
                _adam_block(p5, g5, m5, v5, s5, n5, lr5, pid - e4, beta2, omb1, omb2, eps, betas_ptr, BLOCK)


def adam_state(opt: torch.optim.Adam, p: torch.Tensor) -> dict:
    """``opt``'s state of ``p``, made as torch's fused Adam makes it on its first step when it has none yet."""
    st = opt.state[p]
    if not st:
        st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def steppable(optimizers: dict[str, torch.optim.Adam]) -> bool:
    """Whether :func:`step` can take these optimizers: at most six, each one plain Adam (no weight decay,
    amsgrad, maximize or grad scaling) over one float32 contiguous parameter with a gradient, shared betas and
    eps, all on one device where :func:`available`."""
    if triton is None:  # the CPU install: nothing to check
        return False
    opts = list(optimizers.values())
    if not 0 < len(opts) <= GROUPS:
        return False
    ref = opts[0].param_groups[0]
    dev = None
    for opt in opts:
        if len(opt.param_groups) != 1 or len(opt.param_groups[0]["params"]) != 1:
            return False
        g = opt.param_groups[0]
        if (g["betas"] != ref["betas"] or g["eps"] != ref["eps"] or g["weight_decay"] != 0 or g["amsgrad"]
                or g["maximize"] or getattr(opt, "grad_scale", None) is not None):
            return False
        p = g["params"][0]
        if p.grad is None or p.dtype != torch.float32 or not p.is_contiguous() or not p.grad.is_contiguous():
            return False
        st = opt.state.get(p)
        if st and (st["exp_avg"].dtype != torch.float32 or not st["exp_avg"].is_contiguous()
                   or not st["exp_avg_sq"].is_contiguous() or st["step"].device != p.device):
            return False
        dev = dev or p.device
        if p.device != dev:
            return False
    return available(dev)


@torch.no_grad()
def step(optimizers: dict[str, torch.optim.Adam], found_inf: torch.Tensor | None = None) -> None:
    """One Adam step of every optimizer in one kernel launch (and one for the step counts), then drop the
    gradients. ``found_inf`` (a float32 scalar on the device; else each optimizer's ``found_inf`` attribute, as
    the trainer's deferred checks set it for torch's fused Adam) skips the whole step where it is non-zero.
    Only for optimizers :func:`steppable` accepts."""
    opts = list(optimizers.values())
    dev = opts[0].param_groups[0]["params"][0].device
    if found_inf is None:
        found_inf = getattr(opts[0], "found_inf", None)
    flag = _ZERO.setdefault(dev, torch.zeros((), dtype=torch.float32, device=dev)) if found_inf is None \
        else found_inf.to(device=dev, dtype=torch.float32).reshape(())
    args, steps, blocks = [], [], 0
    for opt in opts:
        grp = opt.param_groups[0]
        p = grp["params"][0]
        st = adam_state(opt, p)
        steps.append(st["step"])
        args += [p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"], p.numel(), float(grp["lr"])]
        blocks += triton.cdiv(p.numel(), BLOCK)
    for _ in range(GROUPS - len(opts)):  # empty groups: never reached (no blocks)
        args += args[:5] + [0, 0.0]
    beta1, beta2 = opts[0].param_groups[0]["betas"]
    key = (dev, float(beta1), float(beta2))
    betas = _BETAS.get(key)
    if betas is None:  # float64 on the device, made once per device and betas
        betas = _BETAS[key] = torch.tensor([beta1, beta2], dtype=torch.float64, device=dev)
    if blocks:
        _multi_adam_kernel[(blocks,)](*args, flag, float(beta2), 1.0 - float(beta1), 1.0 - float(beta2),
                                      float(opts[0].param_groups[0]["eps"]), betas, BLOCK=BLOCK)
    if found_inf is None:
        torch._foreach_add_(steps, 1.0)
    else:  # a skipped step does not count, as in torch's fused Adam
        torch._foreach_add_(steps, 1.0 - flag)
    for opt in opts:
        opt.zero_grad(set_to_none=True)
