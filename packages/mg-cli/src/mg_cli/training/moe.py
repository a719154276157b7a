"""Mixture-of-experts bookkeeping of one training step: the auxiliary losses' gradient scale, the expert bias, and
what ``metrics.jsonl`` logs about routing.

Every MoE layer's forward during the step is recorded (replays under activation recomputation, which run inside
backward, are not), and after the step one all-reduce over every rank (pipeline stages without MoE layers take
part with zeros) turns the records into:

* ``load_balancing_loss`` / ``z_loss`` (those enabled): the mean over every MoE layer and micro-batch;
* ``moe_load/<layer>/{min,max,std}``: tokens routed to each expert of the layer (global layer index) as a
  fraction of the mean over its experts, summed over the step's micro-batches and every rank (1.0 = even);
* ``moe_dropped_fraction``: the share of (token, expert) choices capacity dropped, over every layer.

Tensor-parallel peers that route the same tokens count them once each, which scales every count alike and
leaves these fractions and means unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

_LOSSES = ("load_balancing_loss", "z_loss")


class MoEStep:
    """The MoE layers of this rank's model chunks and their records over one step (empty for a dense model)."""

    def __init__(self, run: Any) -> None:
        from mg_parallel.moe import MoELayer

        cfg = run.model_config
        self.enabled = bool(getattr(cfg, "is_moe", False))
        self.grid = run.grid
        self.layers = [(m.layer_number, m.mlp) for chunk in run.model for m in chunk.modules()
                       if isinstance(getattr(m, "mlp", None), MoELayer)]
        self.num_layers = cfg.num_layers if self.enabled else 0
        self.num_experts = cfg.num_experts if self.enabled else 0
        self._records: list[tuple[int, Any]] = []
        self._hooks: list[Any] = []

    def start(self, loss_scale: float, num_micro: int) -> None:
        """Before the step's forward/backward: scale the aux losses as each micro-batch's loss is, and record."""
        self._records = []
        for number, layer in self.layers:
            layer.aux_loss_grad_scale = loss_scale / num_micro
            self._hooks.append(layer.register_forward_hook(self._recorder(number)))

    def _recorder(self, number: int) -> Any:
        def hook(layer: Any, args: Any, out: Any) -> None:
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:  # not a replay in backward
                r = layer.router
                self._records.append((number, dict(r.losses), r.tokens_per_expert, layer.dispatcher.dropped))

        return hook

    def finish(self) -> None:
        """After the step's backward: stop recording, and move the expert biases (aux-loss-free balancing)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for _, layer in self.layers:
            layer.router.update_expert_bias()

    def metrics(self) -> dict[str, float]:
        """The step's routing metrics (see the module doc); a collective over every rank of an MoE model."""
        if not self.enabled:
            return {}
        import torch.distributed as dist

        n = self.num_experts
        # Per layer: counts [n], dropped, choices; then (sum, count) of each loss. Summed on the device, so the
        # records cost no host synchronisation until the one copy back after the all-reduce.
        stats = torch.zeros(self.num_layers, n + 2 + 2 * len(_LOSSES), dtype=torch.float64, device=self.grid.device)
        for number, losses, counts, dropped in self._records:
            row = stats[number]
            row[:n] += counts
            row[n] += dropped
            row[n + 1] += counts.sum()
            for i, key in enumerate(_LOSSES):
                if key in losses:
                    row[n + 2 + 2 * i] += losses[key]
                    row[n + 3 + 2 * i] += 1
        if self.grid.world_size > 1:
            dist.all_reduce(stats)
        stats = stats.cpu()
        out: dict[str, float] = {}
        for i, key in enumerate(_LOSSES):
            total, count = stats[:, n + 2 + 2 * i].sum(), stats[:, n + 3 + 2 * i].sum()
            if count > 0:
                out[key] = float(total / count)
        for layer in range(self.num_layers):
            counts = stats[layer, :n]
            if counts.sum() > 0:
                share = counts / counts.mean()
                out.update({f"moe_load/{layer}/min": float(share.min()), f"moe_load/{layer}/max": float(share.max()),
                            f"moe_load/{layer}/std": float(share.std(unbiased=False))})
        choices = stats[:, n + 1].sum()
        out["moe_dropped_fraction"] = float(stats[:, n].sum() / choices) if choices > 0 else 0.0
        return out
