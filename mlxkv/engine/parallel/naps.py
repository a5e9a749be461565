"""What keeps an idle tensor-parallel group off the CPU: MLX's ring backend waits for a message by
polling its socket, so a rank waiting in a collective uses a whole core. While rank 0 has no step to
run it sends the other ranks a `Nap` instead of leaving them waiting: they sleep that long, then wait
for its next message, which it sends when the nap ends (another nap) or at once (a step's plan,
which then waits for them: the first step after an idle spell starts up to one nap late)."""

from __future__ import annotations

from dataclasses import dataclass

FIRST_NAP_S = 0.01  # right after a step: another step is likely soon


@dataclass(frozen=True)
class Nap:
    """The other ranks sleep `seconds` before waiting for rank 0's next message."""

    seconds: float


class Naps:
    """Rank 0's naps while idle: from `FIRST_NAP_S` after a step, doubling to `longest_s` (the
    `rank_nap_s` setting: each nap costs each rank a wake-up, about a millisecond of CPU on an idle
    machine, so longer naps cost less and delay the first step after them more). None when 0."""

    def __init__(self, longest_s: float) -> None:
        self.longest_s = longest_s
        self.seconds = min(FIRST_NAP_S, longest_s)

    def next(self) -> Nap | None:
        """The next nap (each one longer, up to `longest_s`), or None if the ranks never nap."""
        if not self.longest_s:
            return None
        nap = Nap(self.seconds)
        self.seconds = min(2 * self.seconds, self.longest_s)
        return nap

    def reset(self) -> None:
        """A step ran: the next idle spell starts with short naps."""
        self.seconds = min(FIRST_NAP_S, self.longest_s)
