"""The errors of a drafter: bad input to a proposer, a drafter that cannot be built, a vocabulary that differs from the
target's, and hidden rows found not finite on the device."""

from __future__ import annotations

from specserve.errors import SpecserveError


class ProposerError(SpecserveError):
    """Bad input to a proposer (unknown session, out-of-range prefix, wrong hidden rows, ...)."""


class DrafterConfigError(ProposerError):
    """A drafter cannot be built from its config or checkpoint (missing file, malformed head, ...)."""


class VocabMismatchError(DrafterConfigError):
    """The drafter's vocabulary differs from the target's."""


class RowsNotFinite(ProposerError):
    """A family read back a False rows check (SessionState.take_rows_check): Proposer.propose ends the session."""
