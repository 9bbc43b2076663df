"""Tensor / expert parallel target: one process per device, rank 0 drives the others."""

from specserve.target_service.parallel.rendezvous import (
    MULTICAST_OFF,
    ParallelError,
    Rendezvous,
)

__all__ = ["MULTICAST_OFF", "ParallelError", "ParallelTargetEngine", "Rendezvous"]


def __getattr__(name: str):
    if name == "ParallelTargetEngine":  # lazy: the worker module imports this package too
        from specserve.target_service.parallel.engine import ParallelTargetEngine

        return ParallelTargetEngine
    raise AttributeError(name)
