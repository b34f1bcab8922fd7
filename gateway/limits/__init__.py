"""Limits shared by every request: rate limits and token quotas, concurrency slots, the engine gate and
the throttling of failed authentications."""
