"""The counters a part of the host tables keeps for the step meter (``HostTableStore.take_stats``): each part owns
its own, zeroed by its ``new_stats`` and handed over and reset by ``take_stats``."""

from __future__ import annotations


class Counted:
    """A part with counters: ``self.stats`` starts as ``new_stats()`` (the subclass's zeroed dict)."""

    stats: dict

    @staticmethod
    def new_stats() -> dict:
        raise NotImplementedError

    def take_stats(self) -> dict:
        """The counters since the last take, reset."""
        stats, self.stats = self.stats, self.new_stats()
        return stats
