"""API key -> tenant, and the tenant's cache salt.

Keys are compared as SHA-256 digests with ``hmac.compare_digest`` against every stored digest, without an
early exit, so neither the key nor which tenant it belongs to leaks through timing. The tenant comes from
the key alone: nothing else a client sends can choose it.
"""

from __future__ import annotations

import hashlib
import hmac

from guard.config import Tenant


class KeyStore:
    def __init__(self, tenants: list[Tenant], secret: str) -> None:
        self._entries = [(digest, tenant) for tenant in tenants for digest in tenant.key_digests()]
        self._secret = secret.encode()
        self._salts: dict[str, str] = {}  # tenant name -> its salt, computed once

    def tenant_for(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer <key>`` header, or None."""
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = hashlib.sha256(key.strip().encode()).digest()
        found = None
        for stored, tenant in self._entries:
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    def cache_salt(self, tenant: Tenant) -> str:
        """HMAC(secret, tenant): stable per tenant, unguessable across tenants (prefix-cache tenure)."""
        salt = self._salts.get(tenant.name)
        if salt is None:
            salt = hmac.new(self._secret, tenant.name.encode(), hashlib.sha256).hexdigest()
            self._salts[tenant.name] = salt
        return salt
