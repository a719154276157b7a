"""Per-tensor Hugging Face <-> mg conversion: the model as a list of small tensor groups.

Most tensors map one to one (a rename, maybe a transpose or vocabulary padding); a few must be
combined, such as separate q/k/v projections and mg's fused QKV. A :class:`TensorGroup` names the
Hugging Face tensors and the mg tensors of one such unit with the conversion both ways, so a
converter can read one group, convert it and write it before reading the next: memory holds one
group (a few tensors of one layer), never the model. Running the same conversions on ``meta``
tensors gives every output's shape and dtype before any data is read (:func:`converted_specs`),
which lets a writer lay out its files first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["TensorGroup", "converted_specs", "iter_converted", "mapped", "rename", "to_hf_state", "to_mg_state"]

Direction = Literal["mg", "hf"]


def _identity(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tensors


@dataclass(frozen=True)
class TensorGroup:
    """Hugging Face tensors ``hf`` <-> mg tensors ``mg`` (unsharded, mg names without prefix).

    ``to_mg(*hf_tensors)`` returns the mg tensors in the order of ``mg``; ``to_hf(*mg_tensors)``
    the Hugging Face ones in the order of ``hf``. Both are pure tensor functions (they also run
    on ``meta`` tensors).
    """

    hf: tuple[str, ...]
    """Hugging Face tensor names."""
    mg: tuple[str, ...]
    """mg tensor names."""
    to_mg: Callable[..., tuple[torch.Tensor, ...]] = _identity
    """Hugging Face tensors -> mg tensors."""
    to_hf: Callable[..., tuple[torch.Tensor, ...]] = _identity
    """mg tensors -> Hugging Face tensors."""


def rename(hf: str, mg: str) -> TensorGroup:
    """A tensor stored identically under two names."""
    return TensorGroup((hf,), (mg,))


def mapped(hf: str, mg: str, to_mg: Callable[[torch.Tensor], torch.Tensor],
           to_hf: Callable[[torch.Tensor], torch.Tensor]) -> TensorGroup:
    """One tensor changed by ``to_mg`` (and back by ``to_hf``): a transpose, vocabulary padding."""
    return TensorGroup((hf,), (mg,), lambda t: (to_mg(t),), lambda t: (to_hf(t),))


def _run(group: TensorGroup, to: Direction, inputs: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    fn, names = (group.to_mg, group.mg) if to == "mg" else (group.to_hf, group.hf)
    outputs = fn(*inputs)
    if len(outputs) != len(names):
        raise AssertionError(f"tensor group {names} produced {len(outputs)} tensors")
    return list(zip(names, outputs))


def iter_converted(groups: Iterable[TensorGroup], read: Callable[[list[str]], dict[str, torch.Tensor]],
                   to: Direction) -> Iterator[tuple[str, torch.Tensor]]:
    """Convert group by group: ``read(names)`` gives the source tensors of one group; yields ``(name, tensor)``.

    ``to="mg"`` reads Hugging Face names and yields mg ones; ``to="hf"`` the reverse. Only one
    group's tensors are referenced at a time.
    """
    for group in groups:
        sources = group.hf if to == "mg" else group.mg
        got = read(list(sources))
        inputs = [got[n] for n in sources]
        del got
        yield from _run(group, to, inputs)


def converted_specs(groups: Iterable[TensorGroup], spec: Callable[[str], tuple[Sequence[int], torch.dtype]],
                    to: Direction) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of every output of :func:`iter_converted`, in its order, without reading data.

    ``spec(name)`` gives a source tensor's shape and dtype (e.g. from a safetensors header); the
    conversions run on ``meta`` tensors.

    Raises:
        ValueError: a source shape the conversion cannot handle (the message names the group).
    """
    out = []
    for group in groups:
        sources = group.hf if to == "mg" else group.mg
        metas = []
        for n in sources:
            shape, dtype = spec(n)
            metas.append(torch.empty(tuple(shape), dtype=dtype, device="meta"))
        try:
            converted = _run(group, to, metas)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"tensors {list(sources)} do not fit the model's config.json: "
                             f"{str(e).splitlines()[0]}") from None
        out += [(name, tuple(t.shape), t.dtype) for name, t in converted]
    return out


def to_mg_state(groups: Iterable[TensorGroup], hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole mg state dict from a whole Hugging Face one (KeyError naming a missing tensor)."""
    return dict(iter_converted(groups, lambda names: {n: hf[n] for n in names}, "mg"))


def to_hf_state(groups: Iterable[TensorGroup], mg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole Hugging Face state dict from a whole mg one (KeyError naming a missing tensor)."""
    return dict(iter_converted(groups, lambda names: {n: mg[n] for n in names}, "hf"))
