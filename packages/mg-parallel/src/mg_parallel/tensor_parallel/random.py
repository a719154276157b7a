"""Random-number streams for tensor parallelism.

Dropout must draw the same mask on every tensor-parallel rank where activations are
replicated (after a row-parallel layer's all-reduce, on the residual stream) and different
masks where each rank holds a different shard (attention probabilities of its own heads,
sequence shards under sequence parallelism). The :class:`RNGTracker` provides both:

* the **default stream** (the device's default generator) is seeded identically on every
  tensor-parallel rank of a pipeline stage: ``seed + 100 * pp_rank``;
* named **forked streams** are separate generator states swapped in by ``tracker.fork()``;
  the built-in ``"tensor-parallel"`` stream is seeded ``seed + 100 * pp_rank + 2718 + tp_rank``,
  i.e. different per tensor-parallel rank (Megatron's offsets, so runs are comparable).

There are no module globals: the model holds its tracker and passes it where needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["TENSOR_PARALLEL_STREAM", "RNGTracker"]

TENSOR_PARALLEL_STREAM = "tensor-parallel"
"""Name of the stream that differs per tensor-parallel rank."""

_PP_OFFSET = 100
_TP_OFFSET = 2718


def _get_device_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    if device.type == "cpu":
        return torch.get_rng_state()
    return getattr(torch, device.type).get_rng_state()


def _set_device_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    elif device.type == "cpu":
        torch.set_rng_state(state)
    else:
        getattr(torch, device.type).set_rng_state(state)


def _seeded_state(device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen.get_state()


class RNGTracker:
    """Seeds the default generator and keeps named generator streams for ``fork()``.

    Args:
        seed: the run's base seed.
        grid: a :class:`mg_parallel.grid.ProcessGrid` (reads ``tp_rank``, ``pp_rank`` and
            ``device``); ``ProcessGrid.single()`` for one process.
        seed_default: also seed the default generators now (the CPU one and, on an
            accelerator, the grid device's) with ``seed + 100 * pp_rank``. Turn it off to
            leave the default stream to the caller.

    Raises:
        ValueError: a negative seed.
    """

    def __init__(self, seed: int, grid: object, *, seed_default: bool = True) -> None:
        if seed < 0:
            raise ValueError(f"RNG seed must be >= 0, got {seed}")
        self.device = torch.device(grid.device)
        self.seed = seed
        self.default_seed = seed + _PP_OFFSET * grid.pp_rank
        self._states: dict[str, torch.Tensor] = {}
        if seed_default:
            torch.manual_seed(self.default_seed)
            if self.device.type != "cpu":
                _set_device_state(self.device, _seeded_state(self.device, self.default_seed))
        self.add(TENSOR_PARALLEL_STREAM, self.default_seed + _TP_OFFSET + grid.tp_rank)

    @property
    def names(self) -> list[str]:
        """Names of the forked streams."""
        return list(self._states)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` on the tracker's device.

        Raises:
            ValueError: the name already exists.
        """
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists in this tracker")
        self._states[name] = _seeded_state(self.device, seed)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_STREAM) -> Iterator[None]:
        """Within the block, the device's default generator draws from stream ``name``.

        On exit the stream's advanced state is stored back and the default generator is
        restored to where it was, so code outside the block sees an untouched default stream.

        Raises:
            KeyError: unknown stream name.
        """
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} not in this tracker (known: {self.names}); add() it first")
        saved = _get_device_state(self.device)
        _set_device_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_device_state(self.device)
            _set_device_state(self.device, saved)

    def get_state(self) -> dict[str, torch.Tensor]:
        """The forked streams' states (``{name: uint8 CPU tensor}``), e.g. for a checkpoint."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_state(self, states: dict[str, torch.Tensor]) -> None:
        """Restore stream states from :meth:`get_state`; streams not in ``states`` are kept."""
        for name, state in states.items():
            self._states[name] = state.clone()

    def get_default_state(self) -> torch.Tensor:
        """The state of the device's default generator (the default stream)."""
        return _get_device_state(self.device)

    def set_default_state(self, state: torch.Tensor) -> None:
        """Restore the device's default generator from :meth:`get_default_state`."""
        _set_device_state(self.device, state)

    def __repr__(self) -> str:
        return f"RNGTracker(seed={self.seed}, device={self.device}, streams={self.names})"
