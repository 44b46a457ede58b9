"""Early stopping on a validation metric: a pure policy over (epoch, value) pairs.

The trainer evaluates the validation split after each epoch and asks :meth:`EarlyStopping.update`
whether the epoch is the best so far (it then keeps a copy of the weights) and
:attr:`EarlyStopping.should_stop` whether to stop. Example, ``patience = 2``::

    epoch   recall@K   update()   bad_epochs   should_stop
      1      0.20       True          0           False
      2      0.25       True          0           False
      3      0.24       False         1           False
      4      0.25       False         2           True     -> epoch 2's weights are kept

A tie is no improvement (the earlier epoch is kept), and a NaN never improves.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class EarlyStopping:
    """Tracks the best epoch of a metric where higher is better."""

    metric: str
    """Key of the evaluation's result read each epoch (``recall@100``)."""
    patience: int
    """Epochs without improvement before :attr:`should_stop` (0: never)."""
    best_epoch: int = 0
    """The best epoch so far (1-based; 0: none evaluated yet)."""
    best_value: float = -math.inf
    bad_epochs: int = 0
    """Epochs evaluated since the best one."""

    def __post_init__(self) -> None:
        if self.patience < 0:
            raise ValueError(f"patience: must be >= 0, got {self.patience}")

    def update(self, epoch: int, value: float) -> bool:
        """Records ``epoch``'s value; True when it is the best so far."""
        if value > self.best_value:  # False for NaN
            self.best_epoch, self.best_value, self.bad_epochs = epoch, value, 0
            return True
        self.bad_epochs += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad_epochs >= self.patience

    def state(self) -> dict[str, Any]:
        """Plain numbers and a string (a checkpoint loads them with ``weights_only``)."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EarlyStopping:
        return cls(**state)
