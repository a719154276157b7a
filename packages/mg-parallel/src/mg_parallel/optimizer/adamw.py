"""Multi-tensor AdamW update on lists of fp32 tensors (the optimizer's main-parameter pieces).

One call updates every tensor of a parameter group. It uses torch's fused AdamW kernel
(``torch._fused_adamw_``: one pass over each tensor, on CPU and CUDA) where the device supports
it, and otherwise torch's multi-tensor ``_foreach`` ops (a few passes per tensor, but one kernel
launch per op for the whole list on GPUs). Both compute torch.optim.AdamW's update (decoupled
weight decay ``p *= 1 - lr * wd``, bias-corrected moments); they differ from its single-tensor
path only by floating-point rounding order (~1 ulp per step).
"""

from __future__ import annotations

import math

import torch

__all__ = ["adamw_update", "fused_adamw_supported"]

_FUSED_OK: dict[tuple[str, torch.dtype], bool] = {}


def fused_adamw_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's fused AdamW kernel runs for tensors of ``dtype`` on ``device`` (probed once, cached)."""
    key = (device.type, dtype)
    if key not in _FUSED_OK:
        ok = hasattr(torch, "_fused_adamw_")
        if ok:
            try:
                p, g, m, v = (torch.zeros(1, device=device, dtype=dtype) for _ in range(4))
                torch._fused_adamw_([p], [g], [m], [v], [], [torch.ones((), device=device)], lr=0.0, beta1=0.9,
                                    beta2=0.9, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
            except (RuntimeError, NotImplementedError):
                ok = False
        _FUSED_OK[key] = ok
    return _FUSED_OK[key]


@torch.no_grad()
def adamw_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, fused: bool | None = None) -> None:
    """One AdamW step, in place, on equally long lists of same-device fp32 tensors of matching shapes.

    Args:
        params, grads, exp_avgs, exp_avg_sqs: main parameters (updated), gradients (read only; already
            unscaled and clipped), first and second moments (updated).
        step: the 1-based step number, for bias correction.
        lr, beta1, beta2, eps, weight_decay: AdamW hyper-parameters (decoupled weight decay).
        fused: True forces the fused kernel, False the ``_foreach`` path, None picks fused when supported.

    Raises:
        ValueError: the lists differ in length, ``step < 1``, or ``fused=True`` on a device without the kernel.
    """
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs)):
        raise ValueError(f"adamw_update: {len(params)} params, {len(grads)} grads, {len(exp_avgs)} exp_avgs and "
                         f"{len(exp_avg_sqs)} exp_avg_sqs; pass one of each per tensor")
    if step < 1:
        raise ValueError(f"adamw_update: step must be >= 1 (1-based), got {step}")
    if not params:
        return
    device, dtype = params[0].device, params[0].dtype
    if fused is None:
        fused = fused_adamw_supported(device, dtype)
    elif fused and not fused_adamw_supported(device, dtype):
        raise ValueError(f"adamw_update: fused=True but torch has no fused AdamW kernel for {dtype} on {device.type}; "
                         f"pass fused=None to fall back to the _foreach path")
    if fused:
        # The kernel reads the step from a tensor (and, unlike torch.optim, never increments it).
        steps = [torch.full((), float(step), device=device)] * len(params)
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(1 - beta2**step))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / (1 - beta1**step))
