"""The gateway's configuration (GatewayConfig): its target and drafts, admission, limits, tokens and data plane."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from specserve.gateway.validation import NO_DRAFT, RequestLimits
from specserve.loop.remote_draft import BreakerConfig
from specserve.runtime.admission import AdmissionConfig
from specserve.runtime.servers_common import TlsFiles, check_address

REQUEST_SHARE = 4  # one request holds at most 1 / REQUEST_SHARE of the running sessions (GatewayConfig.max_choices)


@dataclass(frozen=True)
class GatewayConfig:
    target_address: str
    drafts: Mapping[str, str] = field(default_factory=dict)  # draft name -> draft service address
    default_draft: str | None = None  # None: the first of drafts (if any)
    draft_step_timeout_s: float = 5.0  # a propose slower than this drops the draft for the request
    set_draft_timeout_s: float = 10.0
    max_sessions: int = 64  # requests running at once
    max_queued: int = 64  # requests waiting for one of them; more get RESOURCE_EXHAUSTED
    limits: RequestLimits = field(default_factory=RequestLimits)
    auth_token: str | None = field(default=None, repr=False)  # None: no bearer token required
    downstream_tls: TlsFiles | None = None  # TLS (and client certificate) for the target and draft channels
    # drafts (of ``drafts``) whose q the target may use; the others are verified proposal-only
    trusted_drafts: frozenset[str] = frozenset()
    draft_breaker: BreakerConfig = field(default_factory=BreakerConfig)
    downstream_token: str | None = field(default=None, repr=False)  # bearer token for target and drafts
    # SetDraft needs the metadata `specserve-admin-token: <admin_token>`; None: SetDraft is off
    admin_token: str | None = field(default=None, repr=False)
    # ask target and drafts for the shared-memory data plane (used per session where it opens: same host)
    shm: bool = True
    # with shm: a draft that reads hidden rows gets them in the target's shared buffer where it can map it
    hidden_share: bool = True
    served_model_name: str | None = None  # the model's name in responses and the HTTP API (None: the target's)
    # a target that runs a request's step loop itself (its GetInfo's runs_loop) is handed the request (Run: the
    # served path of issue #42); False: the gateway drives every step (Prefill, VerifyStream, ProposeStream)
    target_loop: bool = True

    @property
    def max_choices(self) -> int:
        """Sessions one request may hold at once (the HTTP API's prompts x n): a quarter of max_sessions, so one
        request never holds them all."""
        return max(1, self.max_sessions // REQUEST_SHARE)

    def __post_init__(self) -> None:
        check_address(self.target_address)
        for name in ("auth_token", "downstream_token", "admin_token"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name} is empty")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name is empty")
        if self.admin_token is not None and self.admin_token == self.auth_token:
            raise ValueError("the admin token must differ from the clients' auth token")
        AdmissionConfig(self.max_sessions, self.max_queued)  # validates both
        for name, address in self.drafts.items():
            if not name or name == NO_DRAFT:
                raise ValueError(f"draft name {name!r} is reserved or empty")
            check_address(address)
        if self.default_draft is not None and self.default_draft not in self.drafts:
            raise ValueError(f"default draft {self.default_draft!r} is not among the drafts {sorted(self.drafts)}")
        if not self.draft_step_timeout_s > 0:
            raise ValueError(f"draft_step_timeout_s must be > 0, got {self.draft_step_timeout_s}")
        object.__setattr__(self, "trusted_drafts", frozenset(self.trusted_drafts))
        unknown = sorted(self.trusted_drafts - set(self.drafts))
        if unknown:
            raise ValueError(f"trusted drafts {unknown} are not among the drafts {sorted(self.drafts)}")
