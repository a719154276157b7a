"""Ten training steps (one fixed batch) of BERT and T5 with DDP and the mg optimizer at tp=2 (+ sequence parallelism
for BERT), at dp=2 with the distributed optimizer and (BERT) as two 1F1B pipeline stages equal single-process
training with torch.optim.AdamW on the full batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mg_models.bert import BertConfig, BertModel
from mg_models.t5 import T5Config, T5Model
from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.testing import run_distributed

from .test_bert_t5_layout import BERT, T5, _full

SEED, STEPS, LR, CLIP = 9, 10, 3e-3, 1.0
B, S, T = 4, 8, 6


def _batch(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 6:] = 0
    labels = torch.full((B, S), -100)
    labels[:, 2:5] = torch.randint(0, 301, (B, 3), generator=gen)
    return dict(ids=torch.randint(0, 301, (B, S), generator=gen), types=torch.randint(0, 2, (B, S), generator=gen),
                mask=mask, labels=labels, nsp=torch.randint(0, 2, (B,), generator=gen),
                dec=torch.randint(0, 301, (B, T), generator=gen), dec_labels=torch.randint(0, 301, (B, T), generator=gen))


def _loss(model: torch.nn.Module, kind: str, d: dict[str, torch.Tensor], rows: slice, dp: int) -> torch.Tensor:
    """Sum-over-this-rank's-rows loss scaled so that DDP's mean over dp ranks is the full-batch loss."""
    d = {k: v[rows] for k, v in d.items()}
    if kind == "bert":
        lm, binary = model(d["ids"], d["types"], d["mask"], lm_labels=d["labels"])
        loss = lm.sum() / (B * 3) + F.cross_entropy(binary, d["nsp"], reduction="sum") / B
    else:
        lm, _ = model(d["ids"], d["dec"], d["mask"], labels=d["dec_labels"])
        loss = lm.sum() / (B * T)
    return loss * dp


def _model(kind: str, grid=None, sp: bool = False) -> torch.nn.Module:
    if kind == "bert":
        return BertModel(BertConfig(**BERT), grid, sequence_parallel=sp, seed=SEED)
    return T5Model(T5Config(**T5, activation="gated-gelu", tie_word_embeddings=False), grid, seed=SEED)


def train_worker(kind: str, tp: int, sp: bool, distopt: bool) -> dict[str, object]:
    from mg_parallel.distributed import DistributedDataParallel, finalize_model_grads
    from mg_parallel.optimizer import OptimizerConfig, build_optimizer

    torch.set_num_threads(1)
    grid = build_grid(ParallelDims(tp=tp))
    model = _model(kind, grid, sp)
    ddp = DistributedDataParallel(model, grid, bucket_size_mb=0.01, use_distributed_optimizer=distopt)
    opt = build_optimizer([ddp], grid, OptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=CLIP,
                                                       use_distributed_optimizer=distopt))
    rows = slice(grid.dp_rank * B // grid.dp_size, (grid.dp_rank + 1) * B // grid.dp_size)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _loss(ddp, kind, _batch(0), rows, grid.dp_size)
        loss.backward()
        finalize_model_grads([ddp], grid)
        _, norm = opt.step()
        full_loss = loss.detach().clone()
        if grid.dp_size > 1:
            torch.distributed.all_reduce(full_loss, group=grid.dp_group)
        losses.append(full_loss.item() / grid.dp_size)
        norms.append(norm)
    params = {n: _full(p, p, grid.tp_group) for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def pipeline_worker() -> dict[str, object]:
    """BERT as two pipeline stages (1F1B, 2 microbatches) with DDP and the mg optimizer."""
    from mg_parallel.distributed import DistributedDataParallel
    from mg_parallel.optimizer import OptimizerConfig, build_optimizer
    from mg_parallel.pipeline import average_losses, get_forward_backward_func

    torch.set_num_threads(1)
    grid = build_grid(ParallelDims(pp=2))
    stage = BertModel(BertConfig(**BERT), grid, pre_process=grid.is_first_stage, post_process=grid.is_last_stage,
                      layer_range=(grid.pp_rank, grid.pp_rank + 1), seed=SEED)
    ddp = DistributedDataParallel(stage, grid, bucket_size_mb=0.01)
    opt = build_optimizer([ddp], grid, OptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=CLIP))
    micro, schedule = 2, get_forward_backward_func(grid)

    def forward_step(rows: slice, model: torch.nn.Module):
        d = {k: v[rows] for k, v in _batch(0).items()}
        output = model(d["ids"], d["types"], d["mask"], lm_labels=d["labels"])

        def loss_fn(out):
            lm, binary = out
            loss = (lm.sum() / (B * 3) + F.cross_entropy(binary, d["nsp"], reduction="sum") / B) * micro
            return loss, {"loss": loss.detach()}

        return output, loss_fn

    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        out = schedule(forward_step, iter([slice(0, B // micro), slice(B // micro, B)]), [ddp], micro, grid,
                       tensor_shape=(S, B // micro, BERT["hidden_size"]), dtype=torch.float32)
        losses.append(average_losses(out, grid))
        norms.append(opt.step()[1])
    return {"losses": losses, "norms": norms, "params": {n: p.detach() for n, p in stage.named_parameters()}}


def _reference(kind: str) -> dict[str, object]:
    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _loss(model, kind, _batch(0), slice(None), 1)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": dict(model.named_parameters())}


def test_ten_steps_match_single_process_adamw():
    for kind, layouts in (("bert", [(2, True, False), (1, False, True)]), ("t5", [(2, False, False)])):
        ref = _reference(kind)
        assert ref["losses"][-1] < ref["losses"][0]  # it trains
        for tp, sp, distopt in layouts:
            for res in run_distributed(train_worker, 2, kind, tp, sp, distopt):
                what = f"{kind} tp={tp} sp={sp} distopt={distopt}"
                torch.testing.assert_close(res["losses"], ref["losses"], atol=1e-5, rtol=1e-5, msg=what)
                torch.testing.assert_close(res["norms"], ref["norms"], atol=1e-5, rtol=1e-5, msg=what)
                for n, p in ref["params"].items():
                    torch.testing.assert_close(res["params"][n], p.detach(), atol=5e-5, rtol=1e-4, msg=f"{what} {n}")
        if kind == "bert":
            stages = run_distributed(pipeline_worker, 2)
            for res in stages:
                torch.testing.assert_close(res["losses"], ref["losses"], atol=1e-5, rtol=1e-5, msg="bert pp=2")
                torch.testing.assert_close(res["norms"], ref["norms"], atol=1e-5, rtol=1e-5, msg="bert pp=2")
            held = {**stages[0]["params"], **stages[1]["params"]}
            assert set(held) == set(ref["params"]) | {"output_layer.weight"}
            # The last stage's copy of the tied embedding received the same updates as the first stage's.
            torch.testing.assert_close(held.pop("output_layer.weight"), held["embedding.word_embeddings.weight"],
                                       atol=0, rtol=0)
            for n, p in ref["params"].items():
                torch.testing.assert_close(held[n], p.detach(), atol=5e-5, rtol=1e-4, msg=f"bert pp=2 {n}")
