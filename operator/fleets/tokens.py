"""Which Secret's admin token may go to pods: the consent rule, written once for both places a token leaves
its Secret (an InferenceDeployment's pods mount it, a PrefixCacheReset sends it).

A namespace user may create InferenceDeployments and PrefixCacheResets without being able to read Secrets;
naming a Secret must not be a way to have its value delivered to pods that user runs. So a token goes out
only when the Secret's owner consented: the Secret carries kvpilot.io/admin-token=true, or it is owned by
the InferenceDeployment that uses it (the token the operator generated for that fleet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpilot.operator.fleets.builders import ADMIN_TOKEN_LABEL
from kvpilot.operator.kube.owners import owned_by
from kvpilot.operator.specs import SecretKeyRef

if TYPE_CHECKING:  # the type alone: this module makes no API call (no import of the client)
    from kvpilot.operator.kube.api import SecretView

NOT_ALLOWED = "AdminTokenNotAllowed"
UNAVAILABLE = "AdminTokenUnavailable"


def refusal(
    secret: SecretView | None, ns: str, ref: SecretKeyRef, owner_uid: str | None, use: str
) -> tuple[str, str] | None:
    """(reason, message) when the token of `ref` may not be used, else None. `secret` is Kube.secret's
    answer; `owner_uid`, the InferenceDeployment whose own Secret counts as consented (None: only the label
    does); `use` says what the token was wanted for, for the message."""
    where = f"Secret {ns}/{ref.name}"
    if secret is None:
        return UNAVAILABLE, f"{where} ({use}) not found"
    owned = owner_uid is not None and owned_by({"metadata": secret}, owner_uid)
    if secret["labels"].get(ADMIN_TOKEN_LABEL) != "true" and not owned:
        mine = " nor owned by the InferenceDeployment" if owner_uid is not None else ""
        return (
            NOT_ALLOWED,
            f"{where} ({use}) is not labelled {ADMIN_TOKEN_LABEL}=true{mine}: a Secret's token goes to pods "
            f"only with its owner's consent (label it: kubectl label secret {ref.name} "
            f"{ADMIN_TOKEN_LABEL}=true)",
        )
    if not secret["data"].get(ref.key, "").strip():
        return UNAVAILABLE, f"{where} ({use}) has no key {ref.key!r}"
    return None
