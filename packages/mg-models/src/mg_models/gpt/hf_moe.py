"""Hugging Face ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` / ``Qwen3MoeForCausalLM`` <-> mg GPT with MoE layers.

Attention, norms, embeddings and dense layers map as for the Llama family (:mod:`mg_models.gpt.hf_llama`:
Mixtral's attention is Mistral's, Qwen2-MoE's Qwen2's, Qwen3-MoE's Qwen3's). An MoE layer's MLP maps
onto :class:`mg_models.transformer.MoEMLP`, whose experts are global tensors (the same at any ep):

==========================================================  =======================================
Hugging Face (per expert ``e``, weights ``[out, in]``)       mg (``decoder.layers.{i}.mlp.``)
==========================================================  =======================================
``gate.weight [N, h]``                                      ``router.weight [N, h]``
``experts.{e}.gate_proj`` / Mixtral ``w1`` ``[f, h]``        ``experts.w1[e, :, 0, :]`` (transposed)
``experts.{e}.up_proj`` / Mixtral ``w3`` ``[f, h]``          ``experts.w1[e, :, 1, :]`` (transposed)
``experts.{e}.down_proj`` / Mixtral ``w2`` ``[h, f]``        ``experts.w2[e]`` (transposed)
``shared_expert.{gate,up,down}_proj`` (Qwen2-MoE)            ``shared_experts.w1[0]``, ``shared_experts.w2[0]``
``shared_expert_gate.weight [1, h]`` (Qwen2-MoE)             ``shared_gate.weight [1, h]``
==========================================================  =======================================

Mixtral's block is ``model.layers.{i}.block_sparse_moe``, Qwen's ``model.layers.{i}.mlp``: the names of
the checkpoint files. transformers 5.x fuses the experts in memory into ``mlp.experts.gate_up_proj
[N, 2f, h]`` (gate rows, then up rows) and ``mlp.experts.down_proj [N, h, f]`` (Mixtral's block renamed
``mlp`` too) and writes the per-expert names back unless saved with ``save_original_format=False``;
:func:`layout_of` picks :data:`FUSED` for a state dict with those names (``model.state_dict()`` of a
loaded model, or such a directory). Each projection of a layer's experts is one
:class:`~mg_models.hf.groups.TensorGroup`, so a streaming conversion holds one layer's gate and up
weights (or its down weights) at a time.

Routing: Mixtral takes the top k logits and a softmax over them (``moe_router_pre_softmax=False``);
Qwen takes a softmax over every expert, then the top k (``moe_router_pre_softmax=True``), renormalised
with ``norm_topk_prob``. Qwen's MoE layers are those with ``(i + 1) % decoder_sparse_step == 0`` and
``i`` not in ``mlp_only_layers`` (an explicit ``moe_layer_freq`` list unless every layer is one).
Hugging Face's balancing loss counts each of the k choices as a whole token, k times mg's (Megatron's)
``f_i``, so ``moe_aux_loss_coeff = k * router_aux_loss_coef``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch

from mg_models.config import GPTConfig
from mg_models.gpt import hf_llama as llama
from mg_models.hf.common import head_to_hf
from mg_models.hf.groups import TensorGroup, rename, to_hf_state, to_mg_state

__all__ = ["FUSED", "MIXTRAL", "MOE_MODEL_TYPES", "QWEN_MOE", "ExpertLayout", "config_from_hf", "config_to_hf",
           "layout_of"]

_BASE = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}
_PREFIX = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}
MOE_MODEL_TYPES = tuple(_BASE)
"""The Hugging Face ``model_type`` s with mixture-of-experts layers."""


def _decimal(x: float) -> float:
    """``x`` without the last-digit noise of a multiplication (0.001 * 6 / 6 reads back as 0.001)."""
    return float(f"{x:.12g}")


def _layer_freq(hf: dict[str, Any], model_type: str, where: str) -> int | list[int]:
    if model_type == "mixtral":
        return 1
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]
    if not any(pattern):
        raise ValueError(f"{where}: decoder_sparse_step={step} with mlp_only_layers={sorted(dense)} leaves no MoE "
                         f"layer; load it as a dense model_type ({_BASE[model_type]!r})")
    return 1 if all(pattern) else pattern


def config_from_hf(hf: dict[str, Any], where: str = "config.json") -> GPTConfig:
    """GPTConfig (with ``num_experts``) from a Mixtral, Qwen2-MoE or Qwen3-MoE ``config.json`` dict.

    Raises:
        ValueError: a feature mg does not implement (names the config.json key).
    """
    model_type = hf.get("model_type", "")
    if model_type not in _BASE:
        raise ValueError(f"{where}: model_type={model_type!r} is not one of {MOE_MODEL_TYPES}")
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise ValueError(f"{where}: no num_experts/num_local_experts; load it as {_BASE[model_type]!r}")
    if model_type != "mixtral" and hf.get("use_sliding_window", False):
        raise ValueError(f"{where}: use_sliding_window=True is not supported for {model_type}; mg's MoE import "
                         f"covers full attention")
    base = llama.config_from_hf({**hf, "model_type": _BASE[model_type], "use_sliding_window": False}
                                if model_type != "mixtral" else {**hf, "model_type": "mistral"})
    k = hf.get("num_experts_per_tok", 2)
    moe: dict[str, Any] = dict(num_experts=experts, moe_router_topk=k, moe_layer_freq=_layer_freq(hf, model_type, where),
                               moe_aux_loss_coeff=_decimal(k * hf.get("router_aux_loss_coef", 0.001)))
    if model_type != "mixtral":
        moe.update(moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_router_pre_softmax=True,
                   moe_router_norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    if model_type == "qwen2_moe":
        moe.update(moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                   moe_shared_expert_gate=True, add_qkv_bias=bool(hf.get("qkv_bias", True)))
    try:
        return dataclasses.replace(base, **moe)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _dense_twin(c: GPTConfig, model_type: str) -> GPTConfig:
    """``c`` without its MoE fields (what the Llama adapter writes the shared keys from)."""
    defaults = {f.name: f.default for f in dataclasses.fields(c) if f.name.startswith("moe_")}
    extra = {"add_qkv_bias": True} if model_type == "qwen2_moe" else {}  # qkv_bias is its own key there
    return dataclasses.replace(c, num_experts=None, **defaults, **extra)


def _check_exportable(c: GPTConfig, model_type: str) -> None:
    name = _PREFIX.get(model_type, model_type)
    if model_type not in _BASE:
        raise ValueError(f"model_type={model_type!r} is not an MoE format; use one of {MOE_MODEL_TYPES}")
    if c.num_experts is None:
        raise ValueError(f"{name} export needs model.num_experts; export a dense model as {_BASE[model_type]!r}")
    problems = [
        (c.moe_router_score_function != "softmax", "model.moe_router_score_function='softmax'"),
        (c.moe_router_enable_expert_bias, "model.moe_router_enable_expert_bias=false"),
        (c.moe_expert_capacity_factor is not None, "model.moe_expert_capacity_factor=null (dropless)"),
        (c.moe_router_pre_softmax != (model_type != "mixtral"),
         f"model.moe_router_pre_softmax={model_type != 'mixtral'}"),
        ((c.moe_shared_expert_intermediate_size is not None) != (model_type == "qwen2_moe"),
         "a shared expert (model.moe_shared_expert_intermediate_size)" if model_type == "qwen2_moe"
         else "no shared expert (model.moe_shared_expert_intermediate_size=null)"),
        (model_type == "qwen2_moe" and not c.moe_shared_expert_gate, "model.moe_shared_expert_gate=true"),
        (model_type == "mixtral" and not all(c.moe_layer_pattern), "every layer an MoE layer (model.moe_layer_freq=1)"),
        (model_type != "mixtral" and c.sliding_window is not None, "model.sliding_window=null"),
    ]
    needed = [what for bad, what in problems if bad]
    if needed:
        raise ValueError(f"{name} export needs {'; '.join(needed)}")


def config_to_hf(c: GPTConfig, model_type: str) -> dict[str, Any]:
    """A Mixtral, Qwen2-MoE or Qwen3-MoE (``model_type``) ``config.json`` dict for ``c``.

    Raises:
        ValueError: ``c`` uses a feature the format cannot express (names the fields to change).
    """
    _check_exportable(c, model_type)
    prefix, k = _PREFIX[model_type], c.moe_router_topk
    out = llama.config_to_hf(_dense_twin(c, model_type), _BASE[model_type])
    out.update(head_to_hf(c, prefix, f"{prefix}ForCausalLM"), model_type=model_type, num_experts_per_tok=k,
               router_aux_loss_coef=_decimal(c.moe_aux_loss_coeff / k), output_router_logits=False)
    if model_type == "mixtral":
        out.update(num_local_experts=c.num_experts, intermediate_size=c.moe_ffn_size, router_jitter_noise=0.0)
        return out
    pattern = c.moe_layer_pattern
    out.update({"num_experts" if model_type == "qwen2_moe" else "num_local_experts": c.num_experts},
               moe_intermediate_size=c.moe_ffn_size, norm_topk_prob=c.moe_router_norm_topk_prob,
               decoder_sparse_step=1, mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])
    if model_type == "qwen2_moe":
        out.update(shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size, qkv_bias=c.qkv_bias)
    return out


def _gate_up_to_mg(*gate_up: torch.Tensor) -> tuple[torch.Tensor]:
    """``(gate_0, up_0, gate_1, up_1, ...)``, each ``[f, h]`` -> ``w1 [N, h, 2, f]``."""
    f, h = gate_up[0].shape
    w1 = gate_up[0].new_empty(len(gate_up) // 2, h, 2, f)
    for j, t in enumerate(gate_up):
        w1[j // 2, :, j % 2].copy_(t.t())
    return (w1,)


def _gate_up_to_hf(w1: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(w1[e, :, j].t().contiguous() for e in range(w1.shape[0]) for j in range(2))


def _down_to_mg(*down: torch.Tensor) -> tuple[torch.Tensor]:
    """``(down_0, down_1, ...)``, each ``[h, f]`` -> ``w2 [N, f, h]``."""
    h, f = down[0].shape
    w2 = down[0].new_empty(len(down), f, h)
    for e, t in enumerate(down):
        w2[e].copy_(t.t())
    return (w2,)


def _down_to_hf(w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(w2[e].t().contiguous() for e in range(w2.shape[0]))


def _fused_gate_up_to_mg(gate_up: torch.Tensor) -> tuple[torch.Tensor]:
    """``gate_up_proj [N, 2f, h]`` (gate rows, then up rows) -> ``w1 [N, h, 2, f]``."""
    n, f2, h = gate_up.shape
    return (gate_up.reshape(n, 2, f2 // 2, h).permute(0, 3, 1, 2).contiguous(),)


def _fused_gate_up_to_hf(w1: torch.Tensor) -> tuple[torch.Tensor]:
    n, h, _, f = w1.shape
    return (w1.permute(0, 2, 3, 1).reshape(n, 2 * f, h).contiguous(),)


def _swap_last(t: torch.Tensor) -> tuple[torch.Tensor]:
    """``down_proj [N, h, f]`` <-> ``w2 [N, f, h]``."""
    return (t.transpose(1, 2).contiguous(),)


def _expert_groups(hf_experts: list[str], mg: str, gate: str, up: str, down: str) -> list[TensorGroup]:
    """Gate+up of the experts named ``hf_experts`` -> ``{mg}.w1``, their down -> ``{mg}.w2``."""
    return [TensorGroup(tuple(f"{e}.{p}.weight" for e in hf_experts for p in (gate, up)), (f"{mg}.w1",),
                        _gate_up_to_mg, _gate_up_to_hf),
            TensorGroup(tuple(f"{e}.{down}.weight" for e in hf_experts), (f"{mg}.w2",), _down_to_mg, _down_to_hf)]


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How one Hugging Face family names an MoE layer's tensors; the adapter of its model types.

    Has the adapter functions of :data:`mg_models.hf.SUPPORTED_MODEL_TYPES` (``config_from_hf``,
    ``config_to_hf``, ``tensor_groups``, ``state_from_hf``, ``state_to_hf``).
    """

    block: str
    """The MoE block under ``model.layers.{i}``: ``block_sparse_moe`` (Mixtral) or ``mlp`` (Qwen)."""
    projections: tuple[str, str, str]
    """Per-expert gate, up and down names: ``(w1, w3, w2)`` (Mixtral) or ``(gate_proj, up_proj, down_proj)``."""
    fused: bool = False
    """The experts are ``experts.gate_up_proj [N, 2f, h]`` and ``experts.down_proj [N, h, f]`` (transformers 5.x
    in memory); ``projections`` is then unused."""

    def config_from_hf(self, hf: dict[str, Any]) -> GPTConfig:
        """See :func:`config_from_hf`."""
        return config_from_hf(hf)

    def config_to_hf(self, c: GPTConfig, model_type: str) -> dict[str, Any]:
        """See :func:`config_to_hf`."""
        return config_to_hf(c, model_type)

    def moe_groups(self, c: GPTConfig, i: int) -> list[TensorGroup]:
        """The groups of MoE layer ``i``'s MLP: router, experts' w1 and w2, and the shared expert and its gate."""
        b, m = f"model.layers.{i}.{self.block}", f"decoder.layers.{i}.mlp"
        groups = [rename(f"{b}.gate.weight", f"{m}.router.weight")]
        if self.fused:
            groups += [TensorGroup((f"{b}.experts.gate_up_proj",), (f"{m}.experts.w1",), _fused_gate_up_to_mg,
                                   _fused_gate_up_to_hf),
                       TensorGroup((f"{b}.experts.down_proj",), (f"{m}.experts.w2",), _swap_last, _swap_last)]
        else:
            groups += _expert_groups([f"{b}.experts.{e}" for e in range(c.num_experts)], f"{m}.experts",
                                     *self.projections)
        if c.moe_shared_expert_intermediate_size is not None:
            groups += _expert_groups([f"{b}.shared_expert"], f"{m}.shared_experts", "gate_proj", "up_proj", "down_proj")
            if c.moe_shared_expert_gate:
                groups.append(rename(f"{b}.shared_expert_gate.weight", f"{m}.shared_gate.weight"))
        return groups

    def tensor_groups(self, c: GPTConfig) -> list[TensorGroup]:
        """The model as per-tensor conversions (the Llama family's, with :meth:`moe_groups` on MoE layers)."""
        return llama.tensor_groups(c, lambda i: self.moe_groups(c, i))

    def state_from_hf(self, hf: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
        """mg (unsharded) state dict from a Hugging Face one. Raises KeyError naming a missing tensor."""
        return to_mg_state(self.tensor_groups(c), hf)

    def state_to_hf(self, mg: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
        """Hugging Face state dict (checkpoint names; no ``lm_head.weight`` when tied) from an mg one."""
        return to_hf_state(self.tensor_groups(c), mg)


MIXTRAL = ExpertLayout(block="block_sparse_moe", projections=("w1", "w3", "w2"))
"""Adapter of ``mixtral``."""
QWEN_MOE = ExpertLayout(block="mlp", projections=("gate_proj", "up_proj", "down_proj"))
"""Adapter of ``qwen2_moe`` and ``qwen3_moe``."""
FUSED = ExpertLayout(block="mlp", projections=("gate_proj", "up_proj", "down_proj"), fused=True)
"""The layout of all three types in transformers 5.x's memory (and its ``save_original_format=False`` files)."""


def layout_of(names: Collection[str], layout: ExpertLayout) -> ExpertLayout:
    """:data:`FUSED` when ``names`` (of a Hugging Face state dict) hold fused experts, else ``layout``."""
    return FUSED if any(n.endswith(".experts.gate_up_proj") for n in names) else layout
