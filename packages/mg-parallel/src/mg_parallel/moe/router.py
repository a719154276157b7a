"""Top-k routing and the load-balancing losses.

**Losses.** With ``N`` experts, ``k`` experts per token and ``T`` tokens, the Switch-style
load-balancing loss (Fedus et al., 2021, eq. 4, as Megatron-LM scales it) is

    L_aux = coeff * N * sum_i f_i * P_i,   f_i = c_i / (T k),   P_i = (1/T) sum_t s_ti

where ``c_i`` counts the tokens whose top-k (chosen without the expert bias) contains expert ``i``
and ``s_t`` is token ``t``'s full score distribution (softmax of its logits, or its sigmoid scores
normalised to sum 1). ``"aux_loss"`` takes ``T`` = the micro-batch of one data-parallel rank;
``"seq_aux_loss"`` computes the same per sequence and averages over the batch; ``"global_aux_loss"``
takes ``T`` = the micro-batches of every data-parallel rank together. The z-loss (Zoph et al., 2022)
is ``coeff_z * (1/T) sum_t logsumexp(logits_t)^2`` over the micro-batch.

**Any layout.** When a micro-batch's tokens are split over ranks (sequence parallelism, context
parallelism), the counts, probability sums and z sums are summed over those ``seq_groups`` (and, for
the global loss, ``dp_groups``) in one all-reduce per group, so the loss is that of its definition's
tokens. Each rank then keeps in its graph only its *share*, the loss with ``P_i`` (and the z sum)
restricted to its own tokens: the shares of the ranks add up to the loss, and so do their
gradients. The counts carry no gradient, so no collective runs in backward. Gradients are
*averaged* over the data- and context-parallel ranks (DDP over ``dp_cp_group``), where each rank's
loss estimates the whole objective; so a share reduced over such ``grad_average_groups`` enters the
graph multiplied by their size (cp for the micro-batch losses, cp·dp for the global one), and the
averaged gradient is that of the loss. Sequence-parallel gradients are summed: no factor for tp.

**No tracker collectives.** The share is attached to the router's output probabilities by
:class:`_AttachAuxLoss` (forward: identity; backward: also gives the share the gradient
``aux_loss_grad_scale``), the way Megatron's ``MoEAuxLossAutoScaler`` does, so the loss needs
no term in the user's loss. Its exact value (already reduced) is kept in ``router.losses``.

**Aux-loss-free balancing** (Wang et al., 2024; DeepSeek-V3): ``expert_bias`` is added to the
scores for choosing experts only (the probabilities are the unbiased scores). Training forwards
count the tokens each expert receives; :meth:`TopKRouter.update_expert_bias` sums those counts
over every rank that saw different tokens and applies ``bias_i += rate * sign(mean_j c_j - c_i)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from mg_parallel.gemm import PLAIN_GEMM, Gemm
from mg_parallel.moe.config import MoEConfig
from mg_parallel.tensor_parallel.utils import group_size

__all__ = ["TopKRouter", "update_expert_biases"]

Groups = Sequence[dist.ProcessGroup | None]


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``probs``; in backward the auxiliary ``loss`` receives the gradient ``scale``."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return probs.view_as(probs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.loss_shape, ctx.scale, dtype=ctx.loss_dtype, device=grad.device), None


def _all_reduce(t: torch.Tensor, groups: Groups) -> torch.Tensor:
    for g in groups:
        if group_size(g) > 1:
            dist.all_reduce(t, group=g)
    return t


def _size(groups: Groups) -> int:
    return math.prod(group_size(g) for g in groups)


class TopKRouter(nn.Module):
    """A linear gate choosing ``k`` of ``num_experts`` experts per token.

    Args:
        hidden_size: token width ``h``.
        num_experts: ``N``.
        config: routing and balancing options (:class:`MoEConfig`).
        seq_groups: groups over which one micro-batch's tokens are split (the context-parallel group,
            and the tensor-parallel group under sequence parallelism); their statistics are summed there.
        dp_groups: the data-parallel groups; the global aux loss and the expert bias sum over them too.
        grad_average_groups: those of ``seq_groups`` and ``dp_groups`` over which gradients are averaged
            rather than summed (the layer passes the cp and dp groups).
        dtype, device: of the gate weight ``[N, h]`` (initialised ``normal(0, 0.02)``).
        gemm: the GEMM recipe of the gate projection (``self.gemm``; see :mod:`mg_parallel.gemm`).

    Attributes:
        aux_loss_grad_scale: gradient the auxiliary losses' shares receive in backward (1.0: as if
            added to the loss; set it to what your loss is multiplied by, e.g. ``1/num_microbatches``).
        losses: after a forward, ``{"load_balancing_loss", "z_loss"}`` (the enabled ones), detached,
            the exact values of their definitions.
        tokens_per_expert: after a forward, ``[N]`` choices of this rank's tokens per expert (before any
            capacity dropping), detached.
    """

    def __init__(
        self, hidden_size: int, num_experts: int, config: MoEConfig, *, seq_groups: Groups = (),
        dp_groups: Groups = (), grad_average_groups: Groups = (), dtype: torch.dtype | None = None,
        device: torch.device | str | None = None, gemm: Gemm = PLAIN_GEMM,
    ) -> None:
        super().__init__()
        self.gemm = gemm
        if config.moe_router_topk > num_experts:
            raise ValueError(
                f"moe_router_topk={config.moe_router_topk} exceeds model.num_experts={num_experts}; lower topk"
            )
        self.config, self.num_experts, self.topk = config, num_experts, config.moe_router_topk
        self.seq_groups, self.dp_groups = tuple(seq_groups), tuple(dp_groups)
        self.grad_average_groups = tuple(g for g in grad_average_groups if group_size(g) > 1)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device))
        self.weight.tensor_parallel = False
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=0.02)
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
            self.register_buffer(
                "local_tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32, device=device),
                persistent=False,
            )
        else:
            self.expert_bias = None
        self.aux_loss_grad_scale = 1.0
        self.losses: dict[str, torch.Tensor] = {}
        self.tokens_per_expert: torch.Tensor | None = None

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        if self.config.moe_router_score_function == "sigmoid":
            return torch.sigmoid(logits.float()).to(logits.dtype)
        return torch.softmax(logits.float(), dim=-1).to(logits.dtype)

    def forward(self, x: torch.Tensor, seq_shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Route tokens.

        Args:
            x: tokens ``[T, h]``.
            seq_shape: ``(s, b)`` with ``T = s*b`` and token ``t = i*b + j`` (position ``i`` of sequence
                ``j``, the flattening of ``[s, b, h]``); needed by ``seq_aux_loss``.

        Returns:
            ``(probs [T, k], indices [T, k])``: the weight and the global expert index of each choice.

        Raises:
            ValueError: ``seq_aux_loss`` without ``seq_shape``.
        """
        cfg = self.config
        logits = self.gemm.linear(x, self.weight)  # [T, N]
        post_softmax = cfg.moe_router_score_function == "softmax" and not cfg.moe_router_pre_softmax
        scores = None if post_softmax else self._scores(logits)
        basis = logits if post_softmax else scores
        chosen_by = basis if self.expert_bias is None else basis + self.expert_bias.to(basis.dtype)
        indices = torch.topk(chosen_by.detach(), self.topk, dim=-1).indices  # [T, k]
        self.tokens_per_expert = torch.bincount(indices.flatten(), minlength=self.num_experts)
        if post_softmax:
            probs = torch.softmax(logits.gather(1, indices).float(), dim=-1).to(logits.dtype)
        else:
            probs = scores.gather(1, indices)
            if cfg.moe_router_norm_topk_prob:
                probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += torch.bincount(indices.flatten(), minlength=self.num_experts).float()
        share = self._losses(logits, indices if self.expert_bias is None else None, seq_shape)
        if share is not None and torch.is_grad_enabled():
            probs = _AttachAuxLoss.apply(probs, share, self.aux_loss_grad_scale)
        return probs, indices

    def _losses(
        self, logits: torch.Tensor, indices: torch.Tensor | None, seq_shape: tuple[int, int] | None
    ) -> torch.Tensor | None:
        cfg, n, k = self.config, self.num_experts, self.topk
        aux, z = cfg.uses_aux_loss, cfg.uses_z_loss
        self.losses = {}
        if not (aux or z):
            return None
        kind = cfg.moe_router_load_balancing_type
        t_local = logits.shape[0]
        stats, psum = [], None
        if aux:
            full = self._scores(logits)  # [T, N] every expert's score
            if cfg.moe_router_score_function == "sigmoid":
                full = full / (full.sum(-1, keepdim=True) + 1e-20)
            if indices is None:  # the expert bias changed the choice: the loss counts the unbiased one
                indices = torch.topk(full.detach(), k, dim=-1).indices
            if kind == "seq_aux_loss":
                if seq_shape is None:
                    raise ValueError("moe_router_load_balancing_type='seq_aux_loss' needs the [s, b, h] shape of the tokens")
                s, b = seq_shape
                seq_of = torch.arange(t_local, device=logits.device).remainder(b).repeat_interleave(k)
                counts = torch.zeros(b, n, dtype=torch.float32, device=logits.device)
                counts.index_put_((seq_of, indices.flatten()), torch.ones_like(seq_of, dtype=torch.float32), accumulate=True)
                psum = full.float().view(s, b, n).sum(0)  # [b, N]
            else:
                counts = torch.bincount(indices.flatten(), minlength=n).float()
                psum = full.float().sum(0)  # [N]
            stats += [counts, psum.detach()]
        if z:
            zsum = torch.logsumexp(logits.float(), dim=-1).square().sum()
            stats.append(zsum.detach().reshape(1))
        flat = _all_reduce(torch.cat([t.reshape(-1) for t in stats]), self.seq_groups)
        share = torch.zeros((), dtype=torch.float32, device=logits.device)
        tokens = t_local * _size(self.seq_groups)
        if aux:
            m = psum.numel()
            counts, psum_all = flat[:m].view_as(psum), flat[m : 2 * m].view_as(psum)
            if kind == "global_aux_loss":
                both = _all_reduce(torch.cat([counts.flatten(), psum_all.flatten()]), self.dp_groups)
                counts, psum_all = both[:m].view_as(psum), both[m:].view_as(psum)
                tokens_aux = tokens * _size(self.dp_groups)
            else:
                tokens_aux = tokens if kind == "aux_loss" else seq_shape[0] * _size(self.seq_groups)
            batches = psum.shape[0] if kind == "seq_aux_loss" else 1
            scale = cfg.moe_aux_loss_coeff * n / (k * tokens_aux * tokens_aux * batches)
            self.losses["load_balancing_loss"] = scale * (counts * psum_all).sum()
            over = self.seq_groups + (self.dp_groups if kind == "global_aux_loss" else ())
            share = share + self._averaged_over(over) * scale * (counts * psum).sum()
        if z:
            self.losses["z_loss"] = cfg.moe_z_loss_coeff * flat[-1] / tokens
            share = share + self._averaged_over(self.seq_groups) * cfg.moe_z_loss_coeff * zsum / tokens
        return share

    def _averaged_over(self, groups: Groups) -> int:
        """Product of the sizes of the groups in ``groups`` whose gradients are averaged."""
        return math.prod(group_size(g) for g in self.grad_average_groups if any(g is h for h in groups))

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Apply ``bias += rate * sign(mean load - load)`` with the loads counted since the last call.

        Collective over ``seq_groups`` and ``dp_groups`` (every rank of them must call it); resets the
        counts. Call it once per optimizer step, after backward. No-op without an expert bias.
        """
        if self.expert_bias is None:
            return
        counts = _all_reduce(_all_reduce(self.local_tokens_per_expert.clone(), self.seq_groups), self.dp_groups)
        self.expert_bias += self.config.moe_router_bias_update_rate * torch.sign(counts.mean() - counts)
        self.local_tokens_per_expert.zero_()

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, topk={self.topk}, score={self.config.moe_router_score_function}"


def update_expert_biases(model: nn.Module) -> None:
    """Call :meth:`TopKRouter.update_expert_bias` on every router of ``model`` (collective)."""
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.update_expert_bias()
