"""Packed sequences: with ``document_ids`` no token attends across a document boundary and positions restart per
document, so every document of a packed row gets the logits and per-token losses it gets alone (fp32, CPU), at
tp=1, tp=2 (with and without sequence parallelism) and split into two pipeline stages."""

from __future__ import annotations

import pytest
import torch

from mg_models import GPTConfig, GPTModel
from mg_models.gpt import build_attention_mask, document_position_ids
from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.testing import run_distributed

SEED = 5
VOCAB = 301
CONFIGS = {
    # rope, GQA and a sliding window shorter than the documents: the window still applies inside each one.
    "llama": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  vocab_size=VOCAB, max_position_embeddings=32, position_embedding="rope", normalization="rmsnorm",
                  activation="swiglu", add_bias_linear=False, tie_word_embeddings=False, sliding_window=3),
    # learned absolute positions: the position table is read from 0 again for each document.
    "gpt2": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=32,
                 activation="gelu_tanh"),
}
# Per row: document lengths, then padding (its own document id) up to 16 tokens.
ROWS = [[5, 4, 4], [7, 2, 4]]
S = 16


def _packed() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (len(ROWS), S), generator=gen)
    labels = torch.randint(0, VOCAB, (len(ROWS), S), generator=gen)
    document_ids = torch.empty(len(ROWS), S, dtype=torch.long)
    position_ids = torch.empty(len(ROWS), S, dtype=torch.long)
    for r, lengths in enumerate(ROWS):
        pieces = lengths + [S - sum(lengths)]
        document_ids[r] = torch.repeat_interleave(torch.arange(len(pieces)), torch.tensor(pieces))
        position_ids[r] = torch.cat([torch.arange(n) for n in pieces])
    return {"tokens": tokens, "labels": labels, "document_ids": document_ids, "position_ids": position_ids}


def _documents() -> list[tuple[int, slice]]:
    out = []
    for r, lengths in enumerate(ROWS):
        start = 0
        for n in lengths:
            out.append((r, slice(start, start + n)))
            start += n
    return out


def _run_packed(model: GPTModel, batch: dict[str, torch.Tensor], explicit_positions: bool) -> dict[str, torch.Tensor]:
    positions = batch["position_ids"] if explicit_positions else None
    with torch.no_grad():
        logits = model(batch["tokens"], positions, document_ids=batch["document_ids"], gather_logits=True)
        loss = model(batch["tokens"], positions, batch["labels"], document_ids=batch["document_ids"])
    return {"logits": logits, "loss": loss}


def _assert_documents_match_alone(name: str, packed: dict[str, torch.Tensor]) -> None:
    model = GPTModel(GPTConfig(**CONFIGS[name]), seed=SEED).eval()
    batch = _packed()
    for r, span in _documents():
        with torch.no_grad():
            alone_logits = model(batch["tokens"][r:r + 1, span], gather_logits=True)[0]
            alone_loss = model(batch["tokens"][r:r + 1, span], labels=batch["labels"][r:r + 1, span])[0]
        torch.testing.assert_close(packed["logits"][r, span], alone_logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(packed["loss"][r, span], alone_loss, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("explicit_positions", [True, False])
def test_packed_documents_equal_documents_run_alone(name, explicit_positions):
    model = GPTModel(GPTConfig(**CONFIGS[name]), seed=SEED).eval()
    packed = _run_packed(model, _packed(), explicit_positions)
    _assert_documents_match_alone(name, packed)
    # Without document ids the later documents see the earlier ones: the comparison above is not vacuous.
    with torch.no_grad():
        unpacked = model(_packed()["tokens"], gather_logits=True)
    assert (unpacked[0, 5:9] - packed["logits"][0, 5:9]).abs().max() > 1e-3


def tp_worker() -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """On 2 ranks, for every config: tp=2 with and without sequence parallelism, and two pipeline stages."""
    torch.set_num_threads(1)
    grid = build_grid(ParallelDims(tp=2))
    batch = _packed()
    out: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for name, fields in sorted(CONFIGS.items()):
        config = GPTConfig(**fields)
        out[name] = {}
        for sp in (False, True):
            out[name][f"sp={sp}"] = _run_packed(GPTModel(config, grid, sequence_parallel=sp, seed=SEED).eval(),
                                                batch, explicit_positions=sp)
        stages = [GPTModel(config, grid, pre_process=i == 0, post_process=i == 1, layer_range=(i, i + 1), seed=SEED,
                           sequence_parallel=True).eval() for i in (0, 1)]
        with torch.no_grad():
            stages[1].set_input_tensor(stages[0](batch["tokens"], document_ids=batch["document_ids"]))
            loss = stages[1](batch["tokens"], labels=batch["labels"], document_ids=batch["document_ids"])
            stages[1].set_input_tensor(stages[0](batch["tokens"], document_ids=batch["document_ids"]))
            logits = stages[1](batch["tokens"], document_ids=batch["document_ids"], gather_logits=True)
        out[name]["pipeline"] = {"logits": logits, "loss": loss}
    return out


def test_packed_documents_under_tensor_sequence_and_pipeline_parallelism():
    results = run_distributed(tp_worker, 2)
    for rank_out in results:
        for name, layouts in rank_out.items():
            for packed in layouts.values():
                _assert_documents_match_alone(name, packed)


def test_document_mask_and_positions():
    docs = torch.tensor([[0, 0, 1, 1, 1, 2], [4, 4, 4, 4, 9, 9]])
    torch.testing.assert_close(document_position_ids(docs), torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]]))
    mask = build_attention_mask(2, 6, 0, None, 2, torch.device("cpu"), docs)  # [2, 1, 6, 6]
    q, k = torch.arange(6)[:, None], torch.arange(6)[None, :]
    for r in range(2):
        expected = (k <= q) & (q - k < 2) & (docs[r][:, None] == docs[r][None, :])
        assert torch.equal(mask[r, 0], expected)
    # Decoding with a cache: the queries are the last positions and see only their document's keys.
    step = build_attention_mask(2, 1, 5, None, None, torch.device("cpu"), docs)
    assert step[:, 0, 0].tolist() == [[False] * 5 + [True], [False] * 4 + [True, True]]
    with pytest.raises(ValueError, match=r"document_ids has shape \(2, 5\), expected \[batch, cached \+ new"):
        build_attention_mask(2, 6, 0, None, None, torch.device("cpu"), docs[:, :5])
