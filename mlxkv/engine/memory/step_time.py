"""How long a step takes, fitted as it runs: `fixed + per_token * tokens + per_attended * attended`.

`tokens` are the step's new tokens; `attended` sums, over its rows, new tokens times the context
they attend (a decode row over 4,000 tokens attends 4,000; a chunk of 512 over 8,000, about 4M), which
is what grows a step's attention. The fit is weighted least squares over the steps run, each step
multiplying the past's weight by `FORGET`, so it follows the machine as it warms, throttles or is
shared; where the part per attended pair comes out negative (the two grow together in the steps
seen), it is fitted without it. The scheduler sizes prefill chunks by it (`--max-itl-ms`) and
speculative decoding weighs a draft token's cost by it.

A step's time is what the host spent starting it (building the graph; on a CPU build, where
starting the evaluation computes most of it, nearly all) plus what reading its tokens waited:
the time between two reads would charge a pipelined step with its successor's work.
"""

from __future__ import annotations

import numpy as np

FORGET = 0.97  # weight of the fit's past per step
ATTENDED_UNIT = 1e6  # attended token pairs per unit of the fit (keeps its matrix well scaled)
RIDGE = 1e-9  # keeps the fit defined while the steps seen do not yet vary in every feature


class StepTime:
    """Seconds per step as a function of its tokens and of the context they attend."""

    def __init__(self) -> None:
        self._gram = np.zeros((3, 3))  # weighted sums of x x^T, x = (1, tokens, attended)
        self._moment = np.zeros(3)  # weighted sums of x * seconds
        self._x = np.ones(3)  # the last step's x
        self._coefficients: np.ndarray | None = None

    def record(self, tokens: int, attended: int, seconds: float) -> None:
        """A step of `tokens` new tokens attending `attended` token pairs took `seconds`. Each step
        records once: in place, without temporaries, it costs a few microseconds."""
        self._x[1:] = tokens, attended / ATTENDED_UNIT
        self._gram *= FORGET
        self._gram += self._x[:, None] * self._x
        self._moment *= FORGET
        self._moment += self._x * seconds
        self._coefficients = None

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed, per_token, per_attended_pair) seconds, or None until steps of at least two sizes
        have been seen. A negative slope (noise) is taken as zero."""
        weight, tokens, squares = self._gram[0, 0], self._gram[0, 1], self._gram[1, 1]
        if weight < 4 or weight * squares - tokens**2 <= 1e-6 * weight * squares:
            return None
        if self._coefficients is None:
            self._coefficients = self._solve()
        fixed, per_token, per_unit = self._coefficients
        return float(fixed), float(per_token), float(per_unit) / ATTENDED_UNIT

    def _solve(self) -> np.ndarray:
        """The three coefficients, non-negative: without the attended feature if it fits below zero."""
        ridge = RIDGE * self._gram[0, 0]
        solution = np.linalg.solve(self._gram + ridge * np.eye(3), self._moment)
        if solution[2] < 0:
            solution = np.append(np.linalg.solve(self._gram[:2, :2] + ridge * np.eye(2), self._moment[:2]), 0.0)
        return np.maximum(solution, 0.0)

    def seconds(self, tokens: int, attended: int) -> float | None:
        """The fitted time of a step, or None before there is a fit."""
        fitted = self.coefficients
        if fitted is None:
            return None
        fixed, per_token, per_pair = fitted
        return fixed + per_token * tokens + per_pair * attended
