"""Scheduling and KV bookkeeping: which sequences run each step (decodes first, prefill chunks under a
token budget, fair shares of slots and step time between tenants), and the paged KV blocks they hold,
with the prefix cache's hashes."""
