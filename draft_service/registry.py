"""The one place that maps drafter family names to factories. Nothing else branches on names.

Factories import their module lazily, so building an ``ngram`` drafter never imports model code.

The target decides the size: with a demo@ target (``DrafterConfig.target_checkpoint``, models/model_names.py) the
eagle3, model, dflash, dspark and mtp factories build their demo-size checkpoint scaled to that target
(models/scaled_drafters.py, scaled_dspark.py, scaled_mtp.py); with a checkpoint folder they load it as it is. No family of its
own.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.drafter_errors import DrafterConfigError
from specserve.draft_service.proposer import Proposer

ProposerFactory = Callable[[DrafterConfig], Proposer]


def _ngram(config: DrafterConfig) -> Proposer:
    from specserve.draft_service.ngram import build_ngram_proposer

    return build_ngram_proposer(config)


def _model(config: DrafterConfig) -> Proposer:
    from specserve.draft_service.model_drafter import build_model_proposer

    return build_model_proposer(config)


def _eagle3(config: DrafterConfig) -> Proposer:
    from specserve.draft_service.eagle3 import build_eagle3_proposer

    return build_eagle3_proposer(config)


def _dflash(config: DrafterConfig) -> Proposer:
    from specserve.draft_service.dflash import build_dflash_proposer

    return build_dflash_proposer(config)


def _dspark(config: DrafterConfig) -> Proposer:
    from specserve.draft_service.dspark import build_dspark_proposer

    return build_dspark_proposer(config)


def _mtp(config: DrafterConfig) -> Proposer:
    from specserve.draft_service.mtp import build_mtp_proposer

    return build_mtp_proposer(config)


PROPOSER_FACTORIES: Mapping[str, ProposerFactory] = MappingProxyType(
    {"ngram": _ngram, "model": _model, "eagle3": _eagle3, "dflash": _dflash, "dspark": _dspark, "mtp": _mtp}
)


def build_proposer(config: DrafterConfig) -> Proposer:
    """Build the drafter ``config.family`` names; unknown family -> DrafterConfigError."""
    factory = PROPOSER_FACTORIES.get(config.family)
    if factory is None:
        raise DrafterConfigError(f"unknown drafter family {config.family!r}; known: {sorted(PROPOSER_FACTORIES)}")
    return factory(config)
