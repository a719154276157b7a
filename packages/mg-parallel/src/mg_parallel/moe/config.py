"""The configuration of a mixture-of-experts layer: router, load balancing, dispatch and experts.

Field names follow Megatron-LM's ``TransformerConfig`` (``moe_router_topk``, ...) so a Megatron
command line maps onto it one to one.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MoEConfig"]

_SCORE_FUNCTIONS = ("softmax", "sigmoid")
_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
_DISPATCHERS = ("alltoall", "allgather")
_ACTIVATIONS = ("swiglu", "gelu")


@dataclass(kw_only=True)
class MoEConfig:
    """How an MoE layer routes tokens, balances its experts and computes them."""

    moe_router_topk: int = 2
    """Experts each token is sent to (k)."""
    moe_router_score_function: str = "softmax"
    """``"softmax"`` or ``"sigmoid"``: how router logits become scores."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-k (Qwen/DeepSeek) instead of over the k chosen logits (Mixtral)."""
    moe_router_norm_topk_prob: bool = False
    """Renormalise the k chosen probabilities to sum to 1 (pre-softmax and sigmoid scores)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """``"aux_loss"`` (per micro-batch), ``"seq_aux_loss"`` (per sequence), ``"global_aux_loss"`` (over dp too) or ``"none"``."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (0 disables it)."""
    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss ``mean(logsumexp(logits)^2)``; None disables it."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for expert selection only."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update ``bias += rate * sign(mean_load - load)``."""
    moe_expert_capacity_factor: float | None = None
    """Capacity per expert as a multiple of the even share ``tokens*k/num_experts``; None is dropless."""
    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity factor, pad every expert's input to exactly its capacity (fixed shapes)."""
    moe_token_dispatcher_type: str = "alltoall"
    """``"alltoall"`` (variable-size all-to-all over ep) or ``"allgather"`` (every rank sees every token)."""
    moe_expert_activation: str = "swiglu"
    """Expert MLP: ``"swiglu"`` (``silu(x W_gate) * x W_up``) or ``"gelu"``."""
    moe_grouped_gemm: bool | None = None
    """Compute the local experts with ``torch._grouped_mm``; None picks it off the CPU where this build runs it."""
    moe_shared_expert_intermediate_size: int | None = None
    """FFN size of a shared expert every token goes through; None for none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by ``sigmoid(x w)`` (Qwen-MoE style)."""

    def __post_init__(self) -> None:
        if not isinstance(self.moe_router_topk, int) or self.moe_router_topk < 1:
            raise ValueError(f"moe_router_topk must be a positive integer, got {self.moe_router_topk!r}")
        for name, value, allowed in (
            ("moe_router_score_function", self.moe_router_score_function, _SCORE_FUNCTIONS),
            ("moe_router_load_balancing_type", self.moe_router_load_balancing_type, _BALANCING),
            ("moe_token_dispatcher_type", self.moe_token_dispatcher_type, _DISPATCHERS),
            ("moe_expert_activation", self.moe_expert_activation, _ACTIVATIONS),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor <= 0:
            raise ValueError(
                f"moe_expert_capacity_factor must be > 0 or None (dropless), got {self.moe_expert_capacity_factor}"
            )
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor; set one or turn it off")
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            raise ValueError("moe_router_pre_softmax applies to moe_router_score_function='softmax' only")
        size = self.moe_shared_expert_intermediate_size
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"moe_shared_expert_intermediate_size must be a positive integer or None, got {size!r}")
        if self.moe_shared_expert_gate and size is None:
            raise ValueError("moe_shared_expert_gate needs moe_shared_expert_intermediate_size; set it or turn the gate off")

    @property
    def uses_aux_loss(self) -> bool:
        """A load-balancing loss is computed (a balancing type other than none and a positive coefficient)."""
        return self.moe_router_load_balancing_type != "none" and self.moe_aux_loss_coeff > 0

    @property
    def uses_z_loss(self) -> bool:
        """The router z-loss is computed."""
        return self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff > 0
