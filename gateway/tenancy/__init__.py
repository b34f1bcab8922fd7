"""Tenant administration: tenants and their policies, API keys and admin tokens, usage reports, model
routes and signed audit exports, each change committed with its audit event."""
